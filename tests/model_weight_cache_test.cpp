// The weight cache: a second loading path that bypasses per-tensor checkpoint loading. EPLB must see the
// same expert-slot descriptors through both paths (the seeds' second bug), for every kind of stage.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>

#include "backend/cpu/cpu_backend.hpp"
#include "eplb/placement.hpp"
#include "model/qwen3_moe.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

const char* const kMix = "qwen3moe-tiny-dense-mix";  // layers 0, 1, 3 MoE (16 experts), layer 2 dense

// 20 slots per MoE layer, hot experts replicated, slots shuffled: a placement unlike the checkpoint's order.
eplb::Placement shuffled_placement(int num_moe_layers, int num_experts) {
  eplb::Placement placement = eplb::trivial_placement({num_experts + 4, 1, 1}, num_moe_layers, num_experts);
  std::mt19937 rng(5);
  for (int l = 0; l < num_moe_layers; ++l) {
    auto map = placement.layer(l);
    std::shuffle(map.begin(), map.end(), rng);
  }
  placement.validate();
  return placement;
}

struct ViewSummary {
  int layer_idx, moe_layer_idx, num_slots;
  std::vector<int64_t> gate_up_shape, down_shape;
  std::vector<int32_t> map;
  bool operator==(const ViewSummary&) const = default;
};

std::vector<ViewSummary> summarize(model::Qwen3MoeModel& m) {
  std::vector<ViewSummary> out;
  for (const auto& v : m.expert_slot_views()) {
    out.push_back({v.layer_idx, v.moe_layer_idx, v.num_slots, v.gate_up.shape(), v.down.shape(),
                   std::vector<int32_t>(v.physical_to_logical.begin(), v.physical_to_logical.end())});
  }
  return out;
}

// Every expert-slot tensor of `a` equals `b`'s, bit for bit.
void expect_same_slot_weights(backend::CpuBackend& cpu, model::Qwen3MoeModel& a, model::Qwen3MoeModel& b) {
  const auto va = a.expert_slot_views(), vb = b.expert_slot_views();
  ASSERT_EQ(va.size(), vb.size());
  for (size_t i = 0; i < va.size(); ++i) {
    EXPECT_EQ(cpu.download(va[i].gate_up), cpu.download(vb[i].gate_up)) << "layer " << va[i].layer_idx;
    EXPECT_EQ(cpu.download(va[i].down), cpu.download(vb[i].down)) << "layer " << va[i].layer_idx;
  }
}

std::vector<float> prompt_logits(backend::CpuBackend& cpu, model::Qwen3MoeModel& m) {
  model::KvCache cache = m.create_kv_cache(8);
  const std::vector<int32_t> prompt{3, 17, 42, 5, 99};
  const std::vector<model::SequenceInput> batch{{prompt, &cache}};
  return cpu.download(m.forward(batch)[0]);
}

TEST(WeightCache, WholeModelSeesTheSameDescriptorsAndComputesTheSameLogits) {
  TempDir dir("weight_cache");
  const auto config = model::load_qwen3_moe_config(golden_model_dir(kMix));
  const eplb::Placement placement = shuffled_placement(3, config.num_experts);
  backend::CpuBackend cpu;
  model::Qwen3MoeModel from_checkpoint(config, cpu, {}, &placement);
  model::Checkpoint checkpoint(golden_model_dir(kMix));
  from_checkpoint.load_weights(checkpoint);
  from_checkpoint.save_weight_cache(dir.file("cache.safetensors"));

  model::Qwen3MoeModel from_cache(config, cpu, {}, &placement);
  const auto early_views = from_cache.expert_slot_views();  // before any weight is read
  from_cache.load_weight_cache(dir.file("cache.safetensors"));
  EXPECT_EQ(summarize(from_cache), summarize(from_checkpoint));
  const auto views = from_cache.expert_slot_views();
  ASSERT_EQ(views.size(), early_views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    EXPECT_EQ(views[i].gate_up.data(), early_views[i].gate_up.data()) << "the cache filled other memory";
    EXPECT_EQ(views[i].down.data(), early_views[i].down.data());
  }
  expect_same_slot_weights(cpu, from_cache, from_checkpoint);
  EXPECT_EQ(prompt_logits(cpu, from_cache), prompt_logits(cpu, from_checkpoint));
}

TEST(WeightCache, StagesWithOnlyDenseOrSomeMoeLayers) {
  TempDir dir("weight_cache_stages");
  const auto config = model::load_qwen3_moe_config(golden_model_dir(kMix));
  backend::CpuBackend cpu;
  model::Checkpoint checkpoint(golden_model_dir(kMix));
  // [2, 3): the dense layer only (no descriptor through either path); [1, 3): one MoE layer and the dense
  // one; [3, 4): the last MoE layer and the LM head.
  for (const model::StageRange stage : {model::StageRange{2, 3}, model::StageRange{1, 3}, model::StageRange{3, 4}}) {
    const std::string file = dir.file(fmt::format("stage{}.safetensors", stage.start_layer));
    model::Qwen3MoeModel a(config, cpu, stage);
    a.load_weights(checkpoint);
    a.save_weight_cache(file);
    model::Qwen3MoeModel b(config, cpu, stage);
    b.load_weight_cache(file);
    EXPECT_EQ(summarize(a), summarize(b)) << "stage [" << stage.start_layer << ", " << stage.end_layer << ")";
    EXPECT_EQ(a.expert_slot_views().empty(), stage.start_layer == 2);
    expect_same_slot_weights(cpu, a, b);
  }
}

TEST(WeightCache, RefusesACacheWrittenForSomethingElse) {
  TempDir dir("weight_cache_refuse");
  const auto config = model::load_qwen3_moe_config(golden_model_dir(kMix));
  backend::CpuBackend cpu;
  model::Checkpoint checkpoint(golden_model_dir(kMix));
  model::Qwen3MoeModel trivial(config, cpu);
  trivial.load_weights(checkpoint);
  const std::string file = dir.file("cache.safetensors");
  trivial.save_weight_cache(file);

  const eplb::Placement placement = shuffled_placement(3, config.num_experts);
  model::Qwen3MoeModel replaced(config, cpu, {}, &placement);
  EXPECT_EQ(error_of([&] { replaced.load_weight_cache(file); }).find(file + ": weight cache written for another slot_map.0"), 0u)
      << error_of([&] { replaced.load_weight_cache(file); });
  model::Qwen3MoeModel stage(config, cpu, {0, 2});
  EXPECT_NE(error_of([&] { stage.load_weight_cache(file); }).find("another stage"), std::string::npos);
  // A truncated file is a one-line error, never a crash.
  const std::string truncated = dir.file("truncated.safetensors");
  {
    const std::string bytes = slurp(file);
    std::ofstream(truncated, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  }
  model::Qwen3MoeModel fresh(config, cpu);
  EXPECT_FALSE(error_of([&] { fresh.load_weight_cache(truncated); }).empty());
  EXPECT_FALSE(error_of([&] { fresh.load_weight_cache(dir.file("absent.safetensors")); }).empty());
}

}  // namespace
}  // namespace fulcrum::test

namespace fulcrum::test {
namespace {

// generate --weight-cache: the first run writes one file per rank, the second reads only those (the
// checkpoint file is gone by then) and prints the same tokens, on a layout whose stage 2 is dense only.
TEST(WeightCache, GenerateRestartsFromTheCacheWithoutTheCheckpoint) {
  TempDir dir("weight_cache_cli");
  const std::string model_dir = dir.file("model");
  std::filesystem::create_directories(model_dir);
  for (const char* name : {"config.json", "model.safetensors"}) {
    std::filesystem::copy_file(golden_model_dir(kMix) + "/" + name, model_dir + "/" + name);
  }
  const std::string args = "generate --model " + model_dir + " --prompt-tokens '4 8 15 16' --max-new-tokens 5 --pp 4 " +
                           "--tp 2 --ep 2 --weight-cache " + dir.file("cache");
  const CliRun first = run_cli(dir, args);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  for (int rank = 0; rank < 8; ++rank) {
    EXPECT_TRUE(std::filesystem::exists(dir.file("cache/rank" + std::to_string(rank) + ".safetensors"))) << rank;
  }
  std::filesystem::remove(model_dir + "/model.safetensors");
  const CliRun second = run_cli(dir, args);
  ASSERT_EQ(second.exit_code, 0) << second.err;
  const auto tokens = [](const std::string& out) {
    const size_t begin = out.find("seq0:");
    return out.substr(begin, out.find('\n', begin) - begin);
  };
  EXPECT_EQ(tokens(second.out), tokens(first.out));
}

}  // namespace
}  // namespace fulcrum::test
