// EPLB manager: cadence, layer chunks, the balancedness skip, determinism across ranks, initial placements.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "comm/in_process_communicator.hpp"
#include "eplb/error.hpp"
#include "eplb/metrics.hpp"
#include "eplb/placement_io.hpp"
#include "eplb/planner.hpp"
#include "eplb_runtime/eplb_manager.hpp"
#include "eplb_runtime/initial_placement.hpp"

namespace fulcrum::eplb_runtime {
namespace {

eplb::LoadMatrix skewed_loads(int num_layers, int num_experts, unsigned seed) {
  std::mt19937 rng(seed);
  std::exponential_distribution<double> heavy(0.05);
  eplb::LoadMatrix loads(num_layers, num_experts);
  for (double& v : loads.values) v = std::floor(heavy(rng) * heavy(rng));
  return loads;
}

ManagerOptions quiet_options(std::vector<std::string>* lines = nullptr) {
  ManagerOptions options;
  options.log = [lines](const std::string& line) {
    if (lines != nullptr) lines->push_back(line);
  };
  return options;
}

TEST(EplbRuntimeManager, RebalanceIsDueEveryNPasses) {
  ManagerOptions options = quiet_options();
  options.rebalance_num_iterations = 3;
  EplbManager manager(eplb::trivial_placement({8, 2, 1}, 2, 8), options);
  std::vector<int64_t> due;
  for (int p = 0; p < 10; ++p) {
    if (manager.on_forward_pass()) due.push_back(manager.num_passes());
  }
  EXPECT_EQ(due, (std::vector<int64_t>{3, 6, 9}));
  EXPECT_EQ(manager.options().planner_name, default_planner_name());
}

TEST(EplbRuntimeManager, SingleRankEplbIsReportedLoudly) {
  std::vector<std::string> lines;
  EplbManager manager(eplb::trivial_placement({8, 1, 1}, 1, 8), quiet_options(&lines));
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("single EP rank"), std::string::npos);
}

TEST(EplbRuntimeManager, BadOptionsAreReportedLoudly) {
  const eplb::Placement placement = eplb::trivial_placement({8, 2, 1}, 2, 8);
  ManagerOptions options = quiet_options();
  options.rebalance_num_iterations = 0;
  EXPECT_THROW(EplbManager(placement, options), Error);
  options = quiet_options();
  options.planner_name = "nonexistent";
  EXPECT_THROW(EplbManager(placement, options), Error);
  options = quiet_options();
  options.skip_balancedness = 1.5;
  EXPECT_THROW(EplbManager(placement, options), Error);
  EplbManager manager(placement, quiet_options());
  EXPECT_THROW(manager.rebalance(eplb::LoadMatrix(3, 8)), Error);
}

TEST(EplbRuntimeManager, ChunksCoverSuccessiveLayersAndOnlyThoseChange) {
  const int num_layers = 5, num_experts = 16;
  const eplb::Topology topo{20, 4, 1};
  ManagerOptions options = quiet_options();
  options.rebalance_layers_per_chunk = 2;
  options.skip_balancedness = 1.0;  // replan every layer whose balancedness is below perfect
  options.bytes_per_slot = 1000;
  EplbManager manager(eplb::trivial_placement(topo, num_layers, num_experts), options);
  const eplb::LoadMatrix loads = skewed_loads(num_layers, num_experts, 5);
  const std::vector<std::vector<int>> expected_chunks = {{0, 1}, {2, 3}, {4, 0}, {1, 2}};
  for (const auto& expected : expected_chunks) {
    EXPECT_EQ(manager.next_chunk(), expected);
    const eplb::Placement before = manager.placement();
    const RebalanceReport report = manager.rebalance(loads);
    EXPECT_EQ(report.chunk_layers, expected);
    for (int l = 0; l < num_layers; ++l) {
      const bool in_chunk = std::find(expected.begin(), expected.end(), l) != expected.end();
      const auto old_row = before.layer(l), new_row = manager.placement().layer(l);
      if (!in_chunk) {
        EXPECT_TRUE(std::equal(old_row.begin(), old_row.end(), new_row.begin())) << "layer " << l;
      }
    }
    EXPECT_EQ(report.num_slots_moved, eplb::experts_moved(before, manager.placement()));
    EXPECT_EQ(report.num_bytes_moved + report.num_bytes_local, report.num_slots_moved * 1000);
    EXPECT_GE(report.balancedness_after, report.balancedness_before);
  }
  // The first two rebalances changed skewed layers: the planner's result is better than trivial.
  EXPECT_FALSE(manager.history()[0].skipped);
  EXPECT_GT(manager.history()[0].balancedness_after, manager.history()[0].balancedness_before);
  EXPECT_GT(manager.history()[0].num_slots_moved, 0);
}

TEST(EplbRuntimeManager, SkipsWhenTheCurrentPlacementIsBalancedEnough) {
  std::vector<std::string> lines;
  ManagerOptions options = quiet_options(&lines);
  const eplb::Topology topo{8, 2, 1};
  EplbManager manager(eplb::trivial_placement(topo, 2, 8), options);
  eplb::LoadMatrix uniform(2, 8);
  std::fill(uniform.values.begin(), uniform.values.end(), 10.0);
  const RebalanceReport skipped = manager.rebalance(uniform);
  EXPECT_TRUE(skipped.skipped);
  EXPECT_EQ(skipped.num_slots_moved, 0);
  EXPECT_DOUBLE_EQ(skipped.balancedness_before, 1.0);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("skipped"), std::string::npos);
  // No recorded load at all: every layer is trivially balanced, also a skip.
  const RebalanceReport empty = manager.rebalance(eplb::LoadMatrix(2, 8));
  EXPECT_TRUE(empty.skipped);
  EXPECT_NE(empty.message.find("no load recorded"), std::string::npos);
  // Everything on GPU 0's experts: below the threshold, replanned.
  eplb::LoadMatrix skewed(2, 8);
  for (int l = 0; l < 2; ++l) {
    for (int e = 0; e < 4; ++e) skewed.at(l, e) = 100.0 + e;
  }
  const RebalanceReport moved = manager.rebalance(skewed);
  EXPECT_FALSE(moved.skipped);
  EXPECT_LT(moved.balancedness_before, options.skip_balancedness);
  EXPECT_GT(moved.balancedness_after, moved.balancedness_before);
  EXPECT_EQ(moved.changed_layers, (std::vector<int>{0, 1}));
  EXPECT_EQ(lines.size(), 3u);
}

TEST(EplbRuntimeManager, EveryRankDerivesTheSamePlacement) {
  const int num_ranks = 4, num_layers = 3, num_experts = 16;
  const eplb::Topology topo{20, num_ranks, 2};
  std::vector<eplb::LoadMatrix> rank_loads;
  for (int r = 0; r < num_ranks; ++r) rank_loads.push_back(skewed_loads(num_layers, num_experts, 100 + r));
  std::vector<eplb::Placement> placements(num_ranks);
  comm::run_in_process(num_ranks, [&](int rank, comm::Communicator& comm) {
    ExpertRecorder recorder({RecorderMode::kStat, 8, num_layers, num_experts, {}, 0});
    // Each rank saw different tokens (its own loads), spread over two passes.
    for (int l = 0; l < num_layers; ++l) {
      std::vector<int32_t> ids;
      for (int e = 0; e < num_experts; ++e) ids.insert(ids.end(), static_cast<size_t>(rank_loads[rank].at(l, e)), e);
      recorder.record(l, ids);
    }
    recorder.end_pass();
    recorder.end_pass();
    ManagerOptions options = quiet_options();
    options.rebalance_num_iterations = 2;
    EplbManager manager(eplb::trivial_placement(topo, num_layers, num_experts), options);
    manager.on_forward_pass();
    ASSERT_TRUE(manager.on_forward_pass());
    const RebalanceReport report = rebalance_across_ranks(manager, recorder, comm);
    EXPECT_FALSE(report.skipped);
    placements[rank] = manager.placement();
  });
  // Identical on every rank, and what one process planning on the summed loads gets.
  EplbManager single(eplb::trivial_placement(topo, num_layers, num_experts), quiet_options());
  single.rebalance(eplb::sum_loads(rank_loads));
  for (int r = 0; r < num_ranks; ++r) EXPECT_EQ(placements[r].physical_to_logical_map, single.placement().physical_to_logical_map);
}

TEST(EplbRuntimeManager, DisagreeingPlacementsAreCaught) {
  EXPECT_THROW(comm::run_in_process(2,
                                    [](int rank, comm::Communicator& comm) {
                                      eplb::Placement p = eplb::trivial_placement({4, 2, 1}, 1, 4);
                                      if (rank == 1) std::swap(p.layer(0)[0], p.layer(0)[1]);
                                      check_same_placement(p, comm);
                                    }),
               Error);
}

TEST(EplbRuntimeManager, InitialPlacementFromTrivialAPlacementFileOrALoadsFile) {
  const eplb::Topology topo{10, 2, 1};
  const int num_layers = 2, num_experts = 8;
  const std::string dir = std::filesystem::temp_directory_path().string();
  const std::string tag = std::to_string(::getpid());
  EXPECT_EQ(make_initial_placement("trivial", topo, num_layers, num_experts, "deepseek").physical_to_logical_map,
            eplb::trivial_placement(topo, num_layers, num_experts).physical_to_logical_map);

  const eplb::LoadMatrix loads = skewed_loads(num_layers, num_experts, 9);
  const auto planner = eplb::make_planner("deepseek");
  const eplb::Placement planned = planner->plan(loads, {topo, 1, nullptr});
  const std::string placement_path = dir + "/fulcrum_init_placement_" + tag + ".json";
  eplb::write_placement_file(placement_path, planned, &loads);
  EXPECT_EQ(make_initial_placement(placement_path, topo, num_layers, num_experts, "deepseek").physical_to_logical_map,
            planned.physical_to_logical_map);
  EXPECT_THROW(make_initial_placement(placement_path, {8, 2, 1}, num_layers, num_experts, "deepseek"), Error);
  EXPECT_THROW(make_initial_placement(placement_path, topo, 3, num_experts, "deepseek"), Error);

  // A recorder dump (logical_count) is planned at start.
  ExpertRecorder recorder({RecorderMode::kPerPass, 4, num_layers, num_experts, {}, 0});
  for (int l = 0; l < num_layers; ++l) {
    std::vector<int32_t> ids;
    for (int e = 0; e < num_experts; ++e) ids.insert(ids.end(), static_cast<size_t>(loads.at(l, e)), e);
    recorder.record(l, ids);
  }
  recorder.end_pass();
  const std::string loads_path = dir + "/fulcrum_init_loads_" + tag + ".json";
  recorder.dump(loads_path);
  EXPECT_EQ(make_initial_placement(loads_path, topo, num_layers, num_experts, "deepseek").physical_to_logical_map,
            planned.physical_to_logical_map);
  EXPECT_THROW(make_initial_placement(loads_path, topo, num_layers, 9, "deepseek"), Error);
  EXPECT_THROW(make_initial_placement(dir + "/fulcrum_no_such_file_" + tag, topo, num_layers, num_experts, "deepseek"),
               Error);
  std::filesystem::remove(placement_path);
  std::filesystem::remove(loads_path);
}

}  // namespace
}  // namespace fulcrum::eplb_runtime
