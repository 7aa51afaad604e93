// Dispatch invariants on random placements: static (replicas of the expert, local then node, even spread),
// dynamic (deterministic, uniform), balanced (conservation, right replicas, local first, optimal).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>

#include "eplb/dispatch.hpp"
#include "eplb/metrics.hpp"
#include "eplb/placement.hpp"

namespace fulcrum::eplb {
namespace {

// Every expert at least once, the extra slots random, then shuffled (replicas may share a GPU).
std::vector<int32_t> random_layer_map(const Topology& topo, int num_experts, std::mt19937& rng) {
  std::vector<int32_t> map(topo.num_physical_experts);
  for (int s = 0; s < topo.num_physical_experts; ++s) {
    map[s] = s < num_experts ? s : static_cast<int32_t>(rng() % num_experts);
  }
  std::shuffle(map.begin(), map.end(), rng);
  return map;
}

std::vector<int64_t> random_tokens(int num_gpus, int num_experts, int max_count, std::mt19937& rng) {
  std::vector<int64_t> tokens(static_cast<size_t>(num_gpus) * num_experts);
  for (auto& t : tokens) t = (rng() % 3 == 0) ? 0 : static_cast<int64_t>(rng() % (max_count + 1));
  return tokens;
}

TEST(DispatchAlgorithm, ParsesAndPrints) {
  for (auto a : {DispatchAlgorithm::kStatic, DispatchAlgorithm::kDynamic, DispatchAlgorithm::kBalanced}) {
    EXPECT_EQ(parse_dispatch_algorithm(to_string(a)), a);
  }
  try {
    parse_dispatch_algorithm("roundrobin");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("static|dynamic|balanced"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("roundrobin"), std::string::npos) << e.what();
  }
}

TEST(StaticDispatch, LocalThenNodeThenEvenSpread) {
  std::mt19937 rng(1);
  for (const Topology topo : {Topology{48, 8, 1}, Topology{48, 8, 2}, Topology{64, 16, 4}, Topology{40, 8, 8}}) {
    for (int trial = 0; trial < 20; ++trial) {
      const int num_experts = 32;
      const auto map = random_layer_map(topo, num_experts, rng);
      const auto table = build_static_dispatch(map, num_experts, topo);
      EXPECT_EQ(table.slot_of, build_static_dispatch(map, num_experts, topo).slot_of);  // deterministic
      const auto replicas = replica_slots(map, num_experts);
      for (int e = 0; e < num_experts; ++e) {
        std::map<int, int> sources_per_slot;  // sources that use a replica off their GPU
        std::map<int, std::vector<int>> remote_by_node;
        for (int g = 0; g < topo.num_gpus; ++g) {
          const int slot = table.slot(g, e);
          ASSERT_EQ(map[slot], e) << "source " << g << " expert " << e << " goes to a slot of another expert";
          const bool has_local = std::any_of(replicas[e].begin(), replicas[e].end(),
                                             [&](int s) { return topo.gpu_of_slot(s) == g; });
          const bool has_node = std::any_of(replicas[e].begin(), replicas[e].end(),
                                            [&](int s) { return topo.node_of_slot(s) == topo.node_of_gpu(g); });
          if (has_local) {
            EXPECT_EQ(topo.gpu_of_slot(slot), g);
          } else if (has_node) {
            EXPECT_EQ(topo.node_of_slot(slot), topo.node_of_gpu(g));
            remote_by_node[topo.node_of_gpu(g)].push_back(slot);
          } else {
            remote_by_node[-1].push_back(slot);
          }
        }
        // Within each group of sources dealt together, replicas differ by at most one source.
        for (const auto& [node, slots] : remote_by_node) {
          std::map<int, int> count;
          for (int s : replicas[e]) {
            if (node < 0 || topo.node_of_slot(s) == node) count[s] = 0;
          }
          for (int s : slots) ++count[s];
          int lo = 1 << 30, hi = 0;
          for (const auto& [s, c] : count) { lo = std::min(lo, c); hi = std::max(hi, c); }
          EXPECT_LE(hi - lo, 1) << "expert " << e << " node group " << node;
        }
      }
    }
  }
}

TEST(DynamicDispatch, DeterministicPerSeedAndUniform) {
  const Topology topo{12, 4, 1};
  const std::vector<int32_t> map = {0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 3, 7};  // expert 0 x3, 3 and 7 x2
  DynamicDispatcher a(map, 8, topo, 42), b(map, 8, topo, 42), c(map, 8, topo, 43);
  std::vector<int32_t> seq_a, seq_b, seq_c;
  std::map<int, int> hits;
  const int num_picks = 30000;
  for (int i = 0; i < num_picks; ++i) {
    seq_a.push_back(a.pick(0));
    seq_b.push_back(b.pick(0));
    seq_c.push_back(c.pick(0));
    ++hits[seq_a.back()];
    EXPECT_EQ(a.pick(5), 5);  // a single replica is always chosen
  }
  EXPECT_EQ(seq_a, seq_b);
  EXPECT_NE(seq_a, seq_c);
  ASSERT_EQ(hits.size(), 3u);
  for (int slot : {0, 8, 9}) EXPECT_NEAR(hits[slot], num_picks / 3, num_picks / 3 * 0.05) << "slot " << slot;
}

// Checks the balanced dispatch's invariants and returns its max GPU load.
int64_t check_balanced(const std::vector<int32_t>& map, int num_experts, const Topology& topo,
                       const std::vector<int64_t>& tokens, const BalancedDispatch& out) {
  const int G = topo.num_gpus;
  std::vector<int64_t> routed(tokens.size(), 0), gpu_load(G, 0), gpu_expert(static_cast<size_t>(G) * num_experts, 0);
  EXPECT_EQ(out.expert_route_offsets.size(), static_cast<size_t>(num_experts) + 1);
  for (int e = 0; e < num_experts; ++e) {
    for (int r = out.expert_route_offsets[e]; r < out.expert_route_offsets[e + 1]; ++r) {
      const auto& route = out.routes[r];
      EXPECT_EQ(map[route.slot_idx], e) << "tokens of expert " << e << " sent to slot " << route.slot_idx;
      EXPECT_GT(route.num_tokens, 0);
      routed[static_cast<size_t>(route.src_gpu_idx) * num_experts + e] += route.num_tokens;
      gpu_load[topo.gpu_of_slot(route.slot_idx)] += route.num_tokens;
      gpu_expert[static_cast<size_t>(topo.gpu_of_slot(route.slot_idx)) * num_experts + e] += route.num_tokens;
    }
  }
  EXPECT_EQ(routed, tokens) << "every token assigned exactly once";
  EXPECT_EQ(gpu_load, out.gpu_loads);
  EXPECT_EQ(out.max_gpu_load, *std::max_element(gpu_load.begin(), gpu_load.end()));
  // Local first: a source holding the expert keeps min(its tokens, what its GPU computes of the expert).
  for (int e = 0; e < num_experts; ++e) {
    for (int g = 0; g < G; ++g) {
      int64_t local = 0;
      for (int r = out.expert_route_offsets[e]; r < out.expert_route_offsets[e + 1]; ++r) {
        const auto& route = out.routes[r];
        if (route.src_gpu_idx == g && topo.gpu_of_slot(route.slot_idx) == g) local += route.num_tokens;
      }
      const int64_t on_gpu = gpu_expert[static_cast<size_t>(g) * num_experts + e];
      if (on_gpu > 0) {
        EXPECT_EQ(local, std::min(tokens[static_cast<size_t>(g) * num_experts + e], on_gpu));
      }
    }
  }
  return out.max_gpu_load;
}

TEST(BalancedDispatch, ConservesTokensAndNeverLosesToStaticOrEvenSplit) {
  std::mt19937 rng(2);
  for (const Topology topo : {Topology{48, 8, 1}, Topology{48, 8, 2}, Topology{192, 32, 4}, Topology{40, 8, 8}}) {
    const int num_experts = topo.num_physical_experts >= 128 ? 128 : 32;
    for (int trial = 0; trial < 10; ++trial) {
      const auto map = random_layer_map(topo, num_experts, rng);
      const auto tokens = random_tokens(topo.num_gpus, num_experts, 50, rng);
      BalancedSplitter splitter(map, num_experts, topo);
      BalancedDispatch out;
      splitter.split(tokens, out);
      const int64_t balanced_max = check_balanced(map, num_experts, topo, tokens, out);
      // static
      const auto table = build_static_dispatch(map, num_experts, topo);
      std::vector<int64_t> static_load(topo.num_gpus, 0);
      std::vector<double> expert_total(num_experts, 0.0);
      for (int g = 0; g < topo.num_gpus; ++g) {
        for (int e = 0; e < num_experts; ++e) {
          static_load[topo.gpu_of_slot(table.slot(g, e))] += tokens[static_cast<size_t>(g) * num_experts + e];
          expert_total[e] += static_cast<double>(tokens[static_cast<size_t>(g) * num_experts + e]);
        }
      }
      EXPECT_LE(balanced_max, *std::max_element(static_load.begin(), static_load.end()));
      const auto even = gpu_loads(expert_total, map, topo);
      EXPECT_LE(static_cast<double>(balanced_max), std::ceil(*std::max_element(even.begin(), even.end()) - 1e-9));
      // Reusing the splitter gives the same answer.
      BalancedDispatch again;
      splitter.split(tokens, again);
      EXPECT_EQ(again.gpu_loads, out.gpu_loads);
    }
  }
}

// Brute force: every split of every expert's total over the GPUs that hold it.
int64_t brute_force_min_max(const std::vector<int32_t>& map, int num_experts, const Topology& topo,
                            const std::vector<int64_t>& expert_total) {
  std::vector<std::vector<int>> gpus(num_experts);
  for (int s = 0; s < topo.num_physical_experts; ++s) {
    auto& list = gpus[map[s]];
    if (std::find(list.begin(), list.end(), topo.gpu_of_slot(s)) == list.end()) list.push_back(topo.gpu_of_slot(s));
  }
  std::vector<int64_t> load(topo.num_gpus, 0);
  int64_t best = INT64_MAX;
  std::function<void(int, int, int64_t)> rec = [&](int e, int i, int64_t left) {
    if (e == num_experts) { best = std::min(best, *std::max_element(load.begin(), load.end())); return; }
    const auto& g = gpus[e];
    if (i + 1 == static_cast<int>(g.size())) {
      load[g[i]] += left;
      rec(e + 1, 0, e + 1 < num_experts ? expert_total[e + 1] : 0);
      load[g[i]] -= left;
      return;
    }
    for (int64_t take = 0; take <= left; ++take) {
      load[g[i]] += take;
      rec(e, i + 1, left - take);
      load[g[i]] -= take;
    }
  };
  rec(0, 0, expert_total[0]);
  return best;
}

TEST(BalancedDispatch, OptimalOnTinyInstances) {
  std::mt19937 rng(3);
  for (const Topology topo : {Topology{6, 3, 1}, Topology{8, 4, 2}, Topology{9, 3, 3}}) {
    for (int trial = 0; trial < 60; ++trial) {
      const int num_experts = topo.num_physical_experts - 2 - static_cast<int>(rng() % 2);
      const auto map = random_layer_map(topo, num_experts, rng);
      const auto tokens = random_tokens(topo.num_gpus, num_experts, 4, rng);
      std::vector<int64_t> expert_total(num_experts, 0);
      for (int g = 0; g < topo.num_gpus; ++g) {
        for (int e = 0; e < num_experts; ++e) expert_total[e] += tokens[static_cast<size_t>(g) * num_experts + e];
      }
      BalancedSplitter splitter(map, num_experts, topo);
      BalancedDispatch out;
      splitter.split(tokens, out);
      check_balanced(map, num_experts, topo, tokens, out);
      EXPECT_EQ(out.max_gpu_load, brute_force_min_max(map, num_experts, topo, expert_total)) << "trial " << trial;
    }
  }
}

TEST(BalancedDispatch, RejectsWrongShapes) {
  const Topology topo{6, 3, 1};
  const std::vector<int32_t> missing = {0, 1, 2, 3, 4, 4}, full = {0, 1, 2, 3, 4, 5};
  EXPECT_THROW(BalancedSplitter(missing, 6, topo), Error);  // expert 5 has no replica
  BalancedSplitter splitter(full, 6, topo);
  BalancedDispatch out;
  EXPECT_THROW(splitter.split(std::vector<int64_t>(7, 1), out), Error);
  std::vector<int64_t> tokens(18, 1);
  tokens[4] = -1;
  EXPECT_THROW(splitter.split(tokens, out), Error);
  splitter.split(std::vector<int64_t>(18, 0), out);  // an empty batch is fine
  EXPECT_EQ(out.max_gpu_load, 0);
  EXPECT_TRUE(out.routes.empty());
}

}  // namespace
}  // namespace fulcrum::eplb
