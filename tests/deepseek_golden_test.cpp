// The deepseek planner against reference outputs of DeepSeek's EPLB (../shared/golden/deepseek_eplb):
// exact maps where the case has no equal loads, mean balancedness within 1e-3 everywhere else.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "eplb/metrics.hpp"
#include "eplb/planner.hpp"
#include "test_data.hpp"

namespace fulcrum::eplb {
namespace {

struct GoldenCase {
  std::string name;
  LoadMatrix weight;
  PlanOptions options;
  std::vector<int32_t> expected_map;  // [L][P] flattened
  double balancedness_mean = 0.0;
  bool tie_free = false;
};

GoldenCase load_case(const std::string& path) {
  const auto doc = nlohmann::json::parse(read_text_file(path));
  GoldenCase c;
  c.name = doc["name"];
  c.weight = parse_loads_json(nlohmann::json{{"logical_count", doc["weight"]}}.dump(), path);
  c.options.topology = {doc["num_physical_experts"].get<int>(), doc["num_gpus"].get<int>(), doc["num_nodes"].get<int>()};
  c.options.num_groups = doc["num_groups"];
  for (const auto& row : doc["physical_to_logical_map"]) {
    for (int v : row) c.expected_map.push_back(v);
  }
  c.balancedness_mean = doc["balancedness_mean"];
  c.tie_free = doc["tie_free"];
  return c;
}

TEST(DeepSeekGolden, ReproducesEveryCase) {
  const auto files = test::golden_eplb_files();
  ASSERT_GE(files.size(), 60u) << "golden cases missing under " << test::shared_path("golden/deepseek_eplb");
  const auto planner = make_planner("deepseek");
  int exact_cases = 0;
  for (const auto& file : files) {
    const GoldenCase c = load_case(file);
    const Placement placement = planner->plan(c.weight, c.options);
    const PlacementReport report = evaluate_placement(placement, c.weight);
    EXPECT_NEAR(report.balancedness_mean, c.balancedness_mean, 1e-3) << c.name;
    if (c.tie_free) {
      ++exact_cases;
      EXPECT_EQ(placement.physical_to_logical_map, c.expected_map) << c.name << ": map differs from the reference";
    }
  }
  EXPECT_GE(exact_cases, 8);
}

}  // namespace
}  // namespace fulcrum::eplb
