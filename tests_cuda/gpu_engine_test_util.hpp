#pragma once
// Pieces the GPU engine tests share (gpu_engine_test.cpp, gpu_engine_fp8_test.cpp, gpu_prompt_logprobs_test.cpp):
// step entries, random prompts, the small MoE config whose shapes suit every kernel path, and a greedy decode
// loop that returns every step's tokens and logprobs (for eager vs graph comparisons).
#include <functional>
#include <cmath>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "gpu/gpu_engine.hpp"
#include "model/rng.hpp"

namespace fulcrum::test {

inline model::StepSequence entry(model::SequenceId id, std::span<const int32_t> tokens, bool sample) {
  model::StepSequence s;
  s.id = id;
  s.token_ids = tokens;
  s.sample = sample;
  return s;
}

inline std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  model::Rng rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& v : t) v = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(vocab));
  return t;
}

// A small MoE config (multiples of 16 everywhere, a dense layer among MoE layers) for random device weights.
inline model::Qwen3MoeConfig small_config(int layers = 3) {
  model::Qwen3MoeConfig c;
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.intermediate_size = 384;
  c.moe_intermediate_size = 128;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.num_experts = 32;
  c.num_experts_per_tok = 4;
  c.mlp_only_layers = {1};
  c.norm_topk_prob = true;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 1e6;
  c.max_position_embeddings = 40960;
  return c;
}

// `batch` sequences with prompts of 3, 3 + prompt_step, ... tokens (seeds 7, 8, ...), then `steps` greedy decode
// steps with logprobs: every decoded (token, logprob), step by step. Each entry must succeed with a finite
// logprob; `counters`, when given, gets the engine's counters at the end.
// `before_step(s)`, when given, runs before decode step s (0-based), between steps.
inline std::vector<std::pair<int32_t, float>> greedy_decode(gpu::GpuEngine& engine, int batch, int prompt_step, int steps,
                                                           gpu::GpuEngine::Counters* counters,
                                                           const std::function<void(int)>& before_step = {}) {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<model::StepSequence> first;
  for (int i = 0; i < batch; ++i) {
    prompts.push_back(random_tokens(3 + prompt_step * i, engine.vocab_size(), 7 + i));
    engine.allocate(i, static_cast<int64_t>(prompts.back().size()) + steps + 1);
  }
  for (int i = 0; i < batch; ++i) first.push_back(entry(i, prompts[i], true));
  model::StepOutput out = engine.step(first);
  std::vector<std::pair<int32_t, float>> seen;
  std::vector<int32_t> last = out.tokens;
  for (int s = 0; s < steps; ++s) {
    if (before_step) before_step(s);
    std::vector<model::StepSequence> b;
    for (int i = 0; i < batch; ++i) {
      b.push_back(entry(i, std::span(&last[i], 1), true));
      b.back().want_logprob = true;
    }
    out = engine.step(b);
    for (int i = 0; i < batch; ++i) {
      EXPECT_TRUE(out.errors[i].empty()) << out.errors[i];
      EXPECT_TRUE(std::isfinite(out.logprobs[i]));
      seen.emplace_back(out.tokens[i], out.logprobs[i]);
      last[i] = out.tokens[i];
    }
  }
  if (counters != nullptr) *counters = engine.counters();
  return seen;
}

}  // namespace fulcrum::test
