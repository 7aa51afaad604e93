// Placement validation, derived replica views, metrics and placement files.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "eplb/metrics.hpp"
#include "eplb/placement_io.hpp"
#include "test_data.hpp"

namespace fulcrum::eplb {
namespace {

using test::error_of;

Placement make(const std::vector<int32_t>& map, int num_gpus, int num_experts, int num_nodes = 1) {
  Placement p({static_cast<int>(map.size()), num_gpus, num_nodes}, 1, num_experts);
  p.physical_to_logical_map = map;
  return p;
}

TEST(Placement, TopologyMapsSlotsToGpusAndNodes) {
  const Topology topo{12, 4, 2};
  EXPECT_EQ(topo.slots_per_gpu(), 3);
  EXPECT_EQ(topo.gpu_of_slot(5), 1);
  EXPECT_EQ(topo.node_of_slot(5), 0);
  EXPECT_EQ(topo.node_of_slot(6), 1);
}

TEST(Placement, ValidationNamesTheProblem) {
  EXPECT_EQ(error_of([] { make({0, 1, 2, 0}, 3, 3).validate(); }),
            "physical experts (4) must be a positive multiple of num_gpus (3)");
  EXPECT_EQ(error_of([] { make({0, 1, 1, 0}, 2, 3).validate(); }), "layer 0: logical expert 2 has no replica");
  EXPECT_EQ(error_of([] { make({0, 1, 5, 2}, 2, 3).validate(); }),
            "layer 0 slot 2: logical expert 5 out of range [0, 3)");
  EXPECT_EQ(error_of([] { make({0, 1, 2, 0}, 4, 3, 3).validate(); }),
            "num_gpus (4) must be divisible by num_nodes (3)");
  EXPECT_EQ(error_of([] { make({0, 1}, 2, 3).validate(); }),
            "physical experts (2) must be at least the number of logical experts (3)");
  EXPECT_NO_THROW(make({0, 1, 2, 0}, 2, 3).validate());
}

TEST(Placement, DerivedReplicaViews) {
  const std::vector<int32_t> map{2, 0, 1, 2, 2, 0};
  EXPECT_EQ(replica_counts(map, 3), (std::vector<int>{2, 1, 3}));
  EXPECT_EQ(replica_slots(map, 3), (std::vector<std::vector<int>>{{1, 5}, {2}, {0, 3, 4}}));
  const Placement trivial = trivial_placement({6, 3, 1}, 2, 4);
  EXPECT_EQ(trivial.physical_to_logical_map, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 0, 1}));
  Placement moved = trivial;
  moved.layer(1)[4] = 3;
  EXPECT_EQ(experts_moved(trivial, moved), 1);
}

TEST(Metrics, GpuLoadsSplitEvenlyOverReplicas) {
  // Expert 0 (load 8) has 2 replicas on GPU 0 and 1; expert 1 (load 2) and 2 (load 6) one each.
  const std::vector<double> load{8, 2, 6};
  const std::vector<int32_t> map{0, 1, 0, 2};
  const auto gpu = gpu_loads(load, map, {4, 2, 1});
  EXPECT_EQ(gpu, (std::vector<double>{6, 10}));
  EXPECT_DOUBLE_EQ(balancedness(gpu), 8.0 / 10.0);
  EXPECT_DOUBLE_EQ(balancedness(std::vector<double>{0, 0}), 1.0);
}

TEST(Metrics, LowerBoundIsWaterLevelOrMeanLoad) {
  // One hot expert: 4 slots for loads {12, 1, 1} -> hot expert gets 2 replicas, tau = 6 > W/G = 14/2.
  EXPECT_DOUBLE_EQ(replication_water_level(std::vector<double>{12, 1, 1}, 4), 6.0);
  EXPECT_DOUBLE_EQ(lower_bound_max_gpu_load(std::vector<double>{12, 1, 1}, {4, 2, 1}), 7.0);
  EXPECT_DOUBLE_EQ(lower_bound_max_gpu_load(std::vector<double>{12, 1, 1}, {4, 4, 1}), 6.0);
}

TEST(PlacementFile, RoundTripsAndRejectsBadFiles) {
  const Placement p = trivial_placement({8, 4, 2}, 3, 6);
  LoadMatrix loads(3, 6);
  loads.at(2, 5) = 7.5;
  const auto path = (std::filesystem::temp_directory_path() / "fulcrum_placement_test.json").string();
  write_placement_file(path, p, &loads);
  const Placement back = read_placement_file(path);
  EXPECT_EQ(back.physical_to_logical_map, p.physical_to_logical_map);
  EXPECT_EQ(back.topology.num_gpus, 4);
  EXPECT_EQ(back.topology.num_nodes, 2);
  EXPECT_EQ(back.num_logical_experts, 6);
  const auto doc = nlohmann::json::parse(read_text_file(path));
  EXPECT_DOUBLE_EQ(doc["logical_count"][2][5].get<double>(), 7.5);
  std::filesystem::remove(path);

  EXPECT_EQ(error_of([] {
              parse_placement_json(R"({"physical_to_logical_map": [[0, 1, 1, 0]], "num_logical_experts": 3})", "p.json");
            }),
            "p.json: layer 0: logical expert 2 has no replica");
  EXPECT_EQ(error_of([] { parse_placement_json(R"({"physical_to_logical_map": [[0, 1], [0]]})", "p.json"); }),
            "p.json: physical_to_logical_map[1] has 1 slots, expected 2");
  EXPECT_EQ(error_of([] { parse_placement_json(R"({"num_gpus": 2})", "p.json"); }),
            "p.json: expected an object with \"physical_to_logical_map\"");
  EXPECT_EQ(error_of([] { parse_placement_json(R"({"physical_to_logical_map": [[0, "a"]]})", "p.json"); }),
            "p.json: physical_to_logical_map[0][1] is not an integer: \"a\"");
  EXPECT_EQ(error_of([] { parse_placement_json(R"({"physical_to_logical_map": [[0, -1]]})", "p.json"); }),
            "p.json: physical_to_logical_map[0][1]: logical expert -1 out of range");
  EXPECT_EQ(error_of([] { parse_placement_json(R"({"physical_to_logical_map": [[0]], "num_gpus": 4294967297})", "p.json"); }),
            "p.json: \"num_gpus\" = 4294967297 is out of range");
  EXPECT_EQ(error_of([] { parse_placement_json(R"({"physical_to_logical_map": [[0, 1, 2]], "num_gpus": 2})", "p.json"); }),
            "p.json: physical experts (3) must be a positive multiple of num_gpus (2)");
}

}  // namespace
}  // namespace fulcrum::eplb
