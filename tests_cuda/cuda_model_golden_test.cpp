// The whole Qwen3-MoE model on the CUDA backend against Hugging Face transformers' outputs on the tiny
// golden checkpoints (the same fixtures and tolerances as the CPU golden test, tests/model_golden_test.cpp):
// prompt and router logits within 1e-4 of golden, 8 greedy tokens with the KV cache (except near-ties),
// and the CUDA run beside the CPU one. Skips when no CUDA device is present.
#include <algorithm>
#include <iostream>
#include <map>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "model/generate.hpp"
#include "model/qwen3_moe.hpp"
#include "model_golden_util.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

class CudaGoldenModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) {
      GTEST_SKIP() << "no CUDA device: the CUDA golden model test needs a GPU";
    }
  }
  std::string dir() const { return golden_model_dir(GetParam()); }
};

TEST_P(CudaGoldenModelTest, LogitsRouterLogitsAndGreedyMatchTransformers) {
  backend::CudaBackend cuda;
  expect_model_matches_golden(cuda, GetParam());
}

// The CUDA model beside the CPU reference: prompt logits within 1e-4, and decoding with the KV cache gives
// the same tokens where the CPU's margins are not near-ties.
TEST_P(CudaGoldenModelTest, CudaMatchesCpuModel) {
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(dir());
  model::Checkpoint checkpoint(dir());
  backend::CpuBackend cpu;
  model::Qwen3MoeModel on_cpu(config, cpu);
  on_cpu.load_weights(checkpoint);
  backend::CudaBackend cuda;
  model::Qwen3MoeModel on_cuda(config, cuda);
  on_cuda.load_weights(checkpoint);
  const std::vector<GoldenSequence> golden = read_golden(dir(), static_cast<int>(config.moe_layer_indices().size()));
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& seq : golden) prompts.push_back(seq.input_ids);
  const model::GenerateResult a = model::generate_greedy(on_cpu, cpu, prompts, 4);
  const model::GenerateResult b = model::generate_greedy(on_cuda, cuda, prompts, 4);
  float worst = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const float diff = max_abs_diff(a.prompt_logits[i].data, b.prompt_logits[i].data);
    EXPECT_LE(diff, kLogitTolerance) << "sequence " << i;
    worst = std::max(worst, diff);
    if (golden[i].last_top1_margin >= kNearTieMargin) {
      EXPECT_EQ(a.new_tokens[i], b.new_tokens[i]) << "sequence " << i;
    }
  }
  std::cout << "[ cuda vs cpu ] " << GetParam() << ": max |logits difference| = " << worst << "\n";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaGoldenModelTest,
                         ::testing::Values("qwen3moe-tiny-128e", "qwen3moe-tiny-dense-mix"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace fulcrum::test
