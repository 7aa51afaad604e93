// The fulcrum planner on real Qwen3-30B-A3B loads: balance against deepseek and the lower bound on the
// golden real-load cases, migration-aware replanning between real workloads, hierarchical mode.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>

#include "eplb/fulcrum_planner.hpp"
#include "eplb/metrics.hpp"
#include "eplb/planner.hpp"
#include "test_data.hpp"

namespace fulcrum::eplb {
namespace {

struct RealCase {
  std::string name;
  LoadMatrix weight;
  PlanOptions options;
};

// The golden cases on real loads (qwen3-30b-a3b_*), loads and topology only.
const std::vector<RealCase>& real_golden_cases() {
  static const std::vector<RealCase> cases = [] {
    std::vector<RealCase> result;
    for (const auto& path : test::golden_eplb_files()) {
      if (path.find("/qwen3-30b-a3b_") == std::string::npos) continue;
      const auto doc = nlohmann::json::parse(read_text_file(path));
      RealCase c;
      c.name = doc["name"];
      c.weight = parse_loads_json(nlohmann::json{{"logical_count", doc["weight"]}}.dump(), path);
      c.options.topology = {doc["num_physical_experts"].get<int>(), doc["num_gpus"].get<int>(),
                            doc["num_nodes"].get<int>()};
      c.options.num_groups = doc["num_groups"];
      result.push_back(std::move(c));
    }
    return result;
  }();
  return cases;
}

const std::vector<LoadMatrix>& real_loads() {
  static const std::vector<LoadMatrix> loads = [] {
    std::vector<LoadMatrix> result;
    for (const auto& path : test::real_load_files()) result.push_back(read_loads_file(path));
    return result;
  }();
  return loads;
}

TEST(FulcrumRealLoads, BeatsDeepSeekAndMeetsThresholdsOnGoldenCases) {
  const auto& cases = real_golden_cases();
  ASSERT_EQ(cases.size(), 60u);
  const auto fulcrum = make_planner("fulcrum");
  const auto deepseek = make_planner("deepseek");
  struct Sum {
    int n = 0;
    double fulcrum = 0, deepseek = 0, bound = 0, fulcrum_min = 1.0;
  };
  std::map<std::pair<int, int>, Sum> by_shape;
  for (const auto& c : cases) {
    const Placement f = fulcrum->plan(c.weight, c.options);
    const Placement d = deepseek->plan(c.weight, c.options);
    const PlacementReport fr = evaluate_placement(f, c.weight);
    const PlacementReport dr = evaluate_placement(d, c.weight);
    EXPECT_GE(fr.balancedness_mean, dr.balancedness_mean) << c.name;
    EXPECT_LE(fr.balancedness_mean, fr.lower_bound_balancedness_mean + 1e-12) << c.name;
    const Topology& topo = c.options.topology;
    if (topo.num_gpus == 16) {
      EXPECT_GE(fr.balancedness_mean, 0.9995) << c.name;
    } else if (topo.num_gpus == 32) {
      EXPECT_GE(fr.balancedness_mean, 0.998) << c.name;
    }
    for (int l = 0; l < f.num_layers; ++l) {
      EXPECT_EQ(max_replicas_on_one_gpu(f.layer(l), f.num_logical_experts, topo), 1) << c.name << " layer " << l;
    }
    Sum& s = by_shape[{topo.num_gpus, topo.num_physical_experts}];
    ++s.n;
    s.fulcrum += fr.balancedness_mean;
    s.deepseek += dr.balancedness_mean;
    s.bound += fr.lower_bound_balancedness_mean;
    s.fulcrum_min = std::min(s.fulcrum_min, fr.balancedness_mean);
  }
  std::printf("%5s %6s %6s %9s %9s %9s %9s\n", "gpus", "slots", "cases", "fulcrum", "min", "deepseek", "bound");
  for (const auto& [shape, s] : by_shape) {
    std::printf("%5d %6d %6d %9.5f %9.5f %9.5f %9.5f\n", shape.first, shape.second, s.n, s.fulcrum / s.n,
                s.fulcrum_min, s.deepseek / s.n, s.bound / s.n);
  }
}

// Replanning from a fulcrum placement made for workload i to workload i+1 (cyclically), all 48 layers.
TEST(FulcrumRealLoads, MigrationMovesAThirdOfDeepSeekAtBetterBalance) {
  const auto& loads = real_loads();
  ASSERT_EQ(loads.size(), 12u);
  const auto fulcrum = make_planner("fulcrum");
  const auto deepseek = make_planner("deepseek");
  const std::vector<Topology> shapes = {{160, 16, 1}, {160, 32, 1}, {192, 32, 1}};
  for (const Topology& topo : shapes) {
    int64_t total_f = 0, total_d = 0;
    double worst_ratio = 0.0, worst_balance = 1.0;
    double bal_f = 0, bal_d = 0;
    for (size_t i = 0; i < loads.size(); ++i) {
      const LoadMatrix& before = loads[i];
      const LoadMatrix& after = loads[(i + 1) % loads.size()];
      PlanOptions options;
      options.topology = topo;
      const Placement current = fulcrum->plan(before, options);
      const Placement d = deepseek->plan(after, options);
      options.current = &current;
      const Placement f = fulcrum->plan(after, options);
      const int64_t moves_f = experts_moved(current, f), moves_d = experts_moved(current, d);
      const double bf = evaluate_placement(f, after).balancedness_mean;
      const double bd = evaluate_placement(d, after).balancedness_mean;
      EXPECT_LE(3 * moves_f, moves_d) << "pair " << i << " P=" << topo.num_physical_experts << " G=" << topo.num_gpus;
      EXPECT_GE(bf, std::max(bd, 0.99)) << "pair " << i << " P=" << topo.num_physical_experts << " G=" << topo.num_gpus;
      for (int l = 0; l < f.num_layers; ++l) {
        EXPECT_EQ(max_replicas_on_one_gpu(f.layer(l), f.num_logical_experts, topo), 1);
      }
      worst_ratio = std::max(worst_ratio, static_cast<double>(moves_f) / moves_d);
      worst_balance = std::min(worst_balance, bf - std::max(bd, 0.99));
      total_f += moves_f;
      total_d += moves_d;
      bal_f += bf;
      bal_d += bd;
    }
    const double n = static_cast<double>(loads.size());
    std::printf("G=%d P=%d: moves fulcrum %lld (%.1f%% of slots, %.3f of deepseek's), deepseek %lld; "
                "balancedness fulcrum %.5f deepseek %.5f\n",
                topo.num_gpus, topo.num_physical_experts, static_cast<long long>(total_f),
                100.0 * total_f / (n * 48 * topo.num_physical_experts), static_cast<double>(total_f) / total_d,
                static_cast<long long>(total_d), bal_f / n, bal_d / n);
    std::printf("  worst pair: moves %.3f of deepseek's; smallest margin over max(deepseek, 0.99) %.5f\n",
                worst_ratio, worst_balance);
  }
}

}  // namespace
}  // namespace fulcrum::eplb
