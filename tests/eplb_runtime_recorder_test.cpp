// Expert distribution recorder: the window ring buffer against a brute-force sum, the modes' dumps read
// back by the eplb loads readers, owned-layer subsets, and merging across in-process ranks.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include <nlohmann/json.hpp>

#include "comm/in_process_communicator.hpp"
#include "eplb/loads.hpp"
#include "eplb/error.hpp"
#include "eplb_runtime/expert_recorder.hpp"

namespace fulcrum::eplb_runtime {
namespace {

using Pass = std::vector<std::vector<int32_t>>;  // [moe_layer] -> ids

Pass random_pass(std::mt19937& rng, int num_layers, int num_experts, int max_tokens) {
  Pass pass(static_cast<size_t>(num_layers));
  std::uniform_int_distribution<int> tokens(0, max_tokens), expert(-1, num_experts - 1);
  for (auto& ids : pass) {
    const int n = tokens(rng);
    for (int i = 0; i < n; ++i) ids.push_back(expert(rng));
  }
  return pass;
}

eplb::LoadMatrix brute_force(const std::vector<Pass>& passes, size_t first, size_t last, int num_layers, int num_experts) {
  eplb::LoadMatrix loads(num_layers, num_experts);
  for (size_t p = first; p < last; ++p) {
    for (int l = 0; l < num_layers; ++l) {
      for (const int32_t e : passes[p][static_cast<size_t>(l)]) {
        if (e >= 0) loads.at(l, e) += 1.0;
      }
    }
  }
  return loads;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid()) + ".json")).string();
}

TEST(EplbRuntimeRecorder, WindowEqualsBruteForceSumOverLastPasses) {
  for (const RecorderMode mode : {RecorderMode::kStat, RecorderMode::kPerPass, RecorderMode::kPerToken}) {
    std::mt19937 rng(7);
    const int num_layers = 3, num_experts = 6, buffer_size = 4;
    ExpertRecorder recorder({mode, buffer_size, num_layers, num_experts, {}, 2});
    std::vector<Pass> passes;
    for (int p = 0; p < 11; ++p) {
      passes.push_back(random_pass(rng, num_layers, num_experts, 9));
      for (int l = 0; l < num_layers; ++l) {
        // Two calls per layer (micro-batches) add up.
        const auto& ids = passes.back()[static_cast<size_t>(l)];
        const size_t half = ids.size() / 2;
        recorder.record(l, std::span(ids).first(half));
        recorder.record(l, std::span(ids).subspan(half));
      }
      recorder.end_pass();
      const size_t first = passes.size() > buffer_size ? passes.size() - buffer_size : 0;
      EXPECT_EQ(recorder.window_loads().values, brute_force(passes, first, passes.size(), num_layers, num_experts).values);
      const auto per_pass = recorder.pass_loads();
      ASSERT_EQ(per_pass.size(), passes.size() - first);
      for (size_t i = 0; i < per_pass.size(); ++i) {
        EXPECT_EQ(per_pass[i].values, brute_force(passes, first + i, first + i + 1, num_layers, num_experts).values);
      }
      if (mode == RecorderMode::kPerToken) {
        const auto ids = recorder.pass_token_expert_ids();
        for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(ids[i], passes[first + i]);
      }
    }
    EXPECT_EQ(recorder.num_passes_in_window(), buffer_size);
    EXPECT_EQ(recorder.num_passes_total(), 11);
    recorder.record(0, std::vector<int32_t>{1, 1});  // an open pass is not in the window
    EXPECT_EQ(recorder.window_loads().values,
              brute_force(passes, passes.size() - buffer_size, passes.size(), num_layers, num_experts).values);
    recorder.reset();
    EXPECT_EQ(recorder.num_passes_in_window(), 0);
    recorder.end_pass();
    EXPECT_EQ(recorder.window_loads().values, std::vector<double>(num_layers * num_experts, 0.0));
  }
}

TEST(EplbRuntimeRecorder, ModesAndBadInputs) {
  EXPECT_EQ(parse_recorder_mode("per_pass"), RecorderMode::kPerPass);
  EXPECT_EQ(recorder_mode_name(parse_recorder_mode("per_token")), "per_token");
  EXPECT_THROW(parse_recorder_mode("histogram"), Error);
  EXPECT_THROW(ExpertRecorder({RecorderMode::kStat, 0, 2, 4, {}, 0}), Error);
  EXPECT_THROW(ExpertRecorder({RecorderMode::kStat, 3, 2, 4, {2}, 0}), Error);
  ExpertRecorder recorder({RecorderMode::kStat, 3, 4, 4, {1, 3}, 0});  // a stage owning MoE layers 1 and 3
  EXPECT_THROW(recorder.record(0, std::vector<int32_t>{1}), Error);
  EXPECT_THROW(recorder.record(1, std::vector<int32_t>{4}), Error);
  EXPECT_THROW(recorder.record(1, std::vector<int32_t>{-2}), Error);
  recorder.record(1, std::vector<int32_t>{0, -1, 3, 3});
  recorder.record(3, std::vector<int32_t>{2});
  recorder.end_pass();
  const eplb::LoadMatrix loads = recorder.window_loads();
  ASSERT_EQ(loads.num_layers, 4);
  EXPECT_EQ(loads.values, (std::vector<double>{0, 0, 0, 0, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 1, 0}));
  EXPECT_THROW(recorder.pass_token_expert_ids(), Error);
}

TEST(EplbRuntimeRecorder, DumpsAreReadBackByTheLoadsReaders) {
  std::mt19937 rng(11);
  const int num_layers = 2, num_experts = 5;
  for (const RecorderMode mode : {RecorderMode::kStat, RecorderMode::kPerPass, RecorderMode::kPerToken}) {
    ExpertRecorder recorder({mode, 3, num_layers, num_experts, {}, 1});
    for (int p = 0; p < 5; ++p) {
      const Pass pass = random_pass(rng, num_layers, num_experts, 7);
      for (int l = 0; l < num_layers; ++l) recorder.record(l, pass[static_cast<size_t>(l)]);
      recorder.end_pass();
    }
    const std::string path = temp_path(std::string("fulcrum_recorder_") + std::string(recorder_mode_name(mode)));
    recorder.dump(path);
    EXPECT_EQ(eplb::read_loads_file(path).values, recorder.window_loads().values);
    const std::vector<eplb::LoadMatrix> windows = eplb::read_load_windows_file(path);
    if (mode == RecorderMode::kStat) {
      EXPECT_EQ(windows.size(), 1u);
    } else {
      const auto passes = recorder.pass_loads();
      ASSERT_EQ(windows.size(), passes.size());
      for (size_t i = 0; i < passes.size(); ++i) EXPECT_EQ(windows[i].values, passes[i].values);
    }
    const auto doc = nlohmann::json::parse(eplb::read_text_file(path));
    EXPECT_EQ(doc["mode"], recorder_mode_name(mode));
    EXPECT_EQ(doc["num_passes"], 3);
    EXPECT_EQ(doc.contains("per_token_expert_ids"), mode == RecorderMode::kPerToken);
    if (mode == RecorderMode::kPerToken) {
      EXPECT_EQ(doc["per_token_expert_ids"].get<std::vector<std::vector<std::vector<int32_t>>>>(),
                recorder.pass_token_expert_ids());
    }
    std::filesystem::remove(path);
  }
  // An empty per_pass window still dumps something `fulcrum plan` accepts (one all-zero pass).
  ExpertRecorder empty({RecorderMode::kPerPass, 3, num_layers, num_experts, {}, 0});
  const std::string path = temp_path("fulcrum_recorder_empty");
  empty.dump(path);
  EXPECT_EQ(eplb::read_loads_file(path).values, std::vector<double>(num_layers * num_experts, 0.0));
  std::filesystem::remove(path);
}

TEST(EplbRuntimeRecorder, MergingAcrossRanksSumsEveryRanksTokens) {
  const int num_ranks = 3, num_layers = 4, num_experts = 5, num_passes = 6, buffer_size = 4;
  // passes[rank][pass]; rank r owns MoE layers {r, r + 1} (overlapping stages exercise the sum).
  std::vector<std::vector<Pass>> passes(num_ranks);
  std::mt19937 rng(3);
  for (auto& rank_passes : passes) {
    for (int p = 0; p < num_passes; ++p) rank_passes.push_back(random_pass(rng, num_layers, num_experts, 6));
  }
  std::vector<eplb::LoadMatrix> merged_loads(num_ranks);
  comm::run_in_process(num_ranks, [&](int rank, comm::Communicator& comm) {
    const std::vector<int> owned = {rank, rank + 1};
    ExpertRecorder recorder({RecorderMode::kPerToken, buffer_size, num_layers, num_experts, owned, 1});
    for (int p = 0; p < num_passes; ++p) {
      for (const int l : owned) recorder.record(l, passes[rank][p][static_cast<size_t>(l)]);
      recorder.end_pass();
    }
    merged_loads[rank] = all_reduce_window_loads(recorder, comm);
    recorder.merge_across_ranks(comm);
    EXPECT_EQ(recorder.window_loads().values, merged_loads[rank].values);
    // Per pass: the sum of every rank's owned layers; raw ids concatenated in rank order.
    const auto per_pass = recorder.pass_loads();
    const auto ids = recorder.pass_token_expert_ids();
    ASSERT_EQ(per_pass.size(), static_cast<size_t>(buffer_size));
    for (int age = 0; age < buffer_size; ++age) {
      const int p = num_passes - buffer_size + age;
      for (int l = 0; l < num_layers; ++l) {
        std::vector<int32_t> expected_ids;
        std::vector<double> expected(num_experts, 0.0);
        for (int r = 0; r < num_ranks; ++r) {
          if (l != r && l != r + 1) continue;
          for (const int32_t e : passes[r][p][static_cast<size_t>(l)]) {
            expected_ids.push_back(e);
            if (e >= 0) expected[static_cast<size_t>(e)] += 1.0;
          }
        }
        const auto row = per_pass[static_cast<size_t>(age)].layer(l);
        EXPECT_EQ(std::vector<double>(row.begin(), row.end()), expected) << "pass " << p << " layer " << l;
        EXPECT_EQ(ids[static_cast<size_t>(age)][static_cast<size_t>(l)], expected_ids);
      }
    }
    // The merged window keeps rolling.
    recorder.end_pass();
    EXPECT_EQ(recorder.num_passes_in_window(), buffer_size);
  });
  for (int r = 1; r < num_ranks; ++r) EXPECT_EQ(merged_loads[r].values, merged_loads[0].values);
}

TEST(EplbRuntimeRecorder, MergingRefusesDifferentWindowLengths) {
  EXPECT_THROW(comm::run_in_process(2,
                                    [](int rank, comm::Communicator& comm) {
                                      ExpertRecorder recorder({RecorderMode::kPerPass, 4, 1, 2, {}, 0});
                                      for (int p = 0; p <= rank; ++p) recorder.end_pass();
                                      recorder.merge_across_ranks(comm);
                                    }),
               Error);
}

}  // namespace
}  // namespace fulcrum::eplb_runtime
