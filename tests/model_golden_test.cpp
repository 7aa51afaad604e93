// The CPU model against Hugging Face transformers' own outputs on the three tiny golden checkpoints (the
// fp8 one: the fp32 model of its dequantized weights, no router logits dumped):
// prompt logits and router logits (max abs diff <= 1e-4), 8 greedy tokens with the KV cache (except
// where the golden last-position margin is a near-tie, < 1e-3), and placement (replica) invariance.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <random>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "eplb/json_text.hpp"
#include "model/generate.hpp"
#include "model/qwen3_moe.hpp"
#include "model_golden_util.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

class GoldenModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::string dir() const { return golden_model_dir(GetParam()); }
};

TEST_P(GoldenModelTest, LogitsRouterLogitsAndGreedyMatchTransformers) {
  backend::CpuBackend cpu;
  expect_model_matches_golden(cpu, GetParam());
}

// One sequence at a time gives the same logits as the batch; decoding with the KV cache gives the same
// logits as re-running the longer prompt from scratch.
TEST_P(GoldenModelTest, BatchingAndKvCacheDoNotChangeLogits) {
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(dir());
  backend::CpuBackend cpu;
  model::Qwen3MoeModel qwen(config, cpu);
  model::Checkpoint checkpoint(dir());
  qwen.load_weights(checkpoint);
  const std::vector<GoldenSequence> golden = read_golden(dir(), static_cast<int>(config.moe_layer_indices().size()));
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& seq : golden) prompts.push_back(seq.input_ids);
  const model::GenerateResult batched = model::generate_greedy(qwen, cpu, prompts, 3);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const model::GenerateResult alone = model::generate_greedy(qwen, cpu, {prompts[i]}, 3);
    EXPECT_LE(max_abs_diff(alone.prompt_logits[0].data, batched.prompt_logits[i].data), 1e-6f);
    EXPECT_EQ(alone.new_tokens[0], batched.new_tokens[i]);

    // Logits of the 2 decoded positions via the cache vs a fresh prefill of prompt + decoded tokens.
    std::vector<int32_t> extended = prompts[i];
    extended.insert(extended.end(), batched.new_tokens[i].begin(), batched.new_tokens[i].begin() + 2);
    const model::GenerateResult fresh = model::generate_greedy(qwen, cpu, {extended}, 1);
    model::KvCache cache = qwen.create_kv_cache(static_cast<int64_t>(extended.size()));
    const model::SequenceInput prefill{prompts[i], &cache};
    qwen.forward(std::span(&prefill, 1));
    for (size_t step = 0; step < 2; ++step) {
      const model::SequenceInput decode{std::span(&batched.new_tokens[i][step], 1), &cache};
      const std::vector<float> cached = cpu.download(qwen.forward(std::span(&decode, 1))[0]);
      const size_t row = prompts[i].size() + step;
      const std::span<const float> reference(fresh.prompt_logits[0].data.data() + row * config.vocab_size,
                                             static_cast<size_t>(config.vocab_size));
      EXPECT_LE(max_abs_diff(cached, reference), 1e-5f) << "sequence " << i << " step " << step;
    }
  }
}

// A placement with extra slots (hot experts replicated) and shuffled slot order, identical logits.
eplb::Placement replicated_shuffled_placement(const model::Qwen3MoeConfig& config, uint32_t seed) {
  const int num_experts = config.num_experts;
  const int num_slots = num_experts + num_experts / 4;  // 128 -> 160, 16 -> 20
  const int num_moe_layers = static_cast<int>(config.moe_layer_indices().size());
  eplb::Placement placement(eplb::Topology{num_slots, 4, 1}, num_moe_layers, num_experts);
  std::mt19937 rng(seed);
  for (int layer = 0; layer < num_moe_layers; ++layer) {
    std::vector<int32_t> map(static_cast<size_t>(num_slots));
    for (int s = 0; s < num_experts; ++s) map[s] = s;
    // "Hot" experts: a few get several replicas.
    for (int s = num_experts; s < num_slots; ++s) map[s] = static_cast<int32_t>((s - num_experts) % 5 * 3 % num_experts);
    std::shuffle(map.begin(), map.end(), rng);
    std::copy(map.begin(), map.end(), placement.layer(layer).begin());
  }
  placement.validate();
  return placement;
}

TEST_P(GoldenModelTest, ReplicatedShuffledPlacementGivesSameLogits) {
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(dir());
  backend::CpuBackend cpu;
  model::Checkpoint checkpoint(dir());
  model::Qwen3MoeModel trivial(config, cpu);
  trivial.load_weights(checkpoint);
  const eplb::Placement placement = replicated_shuffled_placement(config, 7);
  model::Qwen3MoeModel replicated(config, cpu, {}, &placement);
  replicated.load_weights(checkpoint);

  // The slot views describe the placement, and every replica slot holds its logical expert's weights.
  const auto trivial_views = trivial.expert_slot_views();
  const auto views = replicated.expert_slot_views();
  ASSERT_EQ(views.size(), config.moe_layer_indices().size());
  for (size_t v = 0; v < views.size(); ++v) {
    ASSERT_EQ(views[v].num_slots, placement.num_physical_experts());
    const auto expected = placement.layer(views[v].moe_layer_idx);
    ASSERT_TRUE(std::equal(expected.begin(), expected.end(), views[v].physical_to_logical.begin()));
    for (int slot = 0; slot < views[v].num_slots; ++slot) {
      const int expert = views[v].physical_to_logical[slot];
      EXPECT_EQ(cpu.download(views[v].gate_up.index(slot)), cpu.download(trivial_views[v].gate_up.index(expert)));
      EXPECT_EQ(cpu.download(views[v].down.index(slot)), cpu.download(trivial_views[v].down.index(expert)));
    }
  }

  const std::vector<GoldenSequence> golden = read_golden(dir(), static_cast<int>(views.size()));
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& seq : golden) prompts.push_back(seq.input_ids);
  const model::GenerateResult a = model::generate_greedy(trivial, cpu, prompts, 4);
  const model::GenerateResult b = model::generate_greedy(replicated, cpu, prompts, 4);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_LE(max_abs_diff(a.prompt_logits[i].data, b.prompt_logits[i].data), 1e-5f);
    EXPECT_EQ(a.new_tokens[i], b.new_tokens[i]);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenModelTest,
                         ::testing::Values("qwen3moe-tiny-128e", "qwen3moe-tiny-dense-mix", "qwen3moe-tiny-fp8"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace fulcrum::test
