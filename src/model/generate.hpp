#pragma once
// Token generation of several sequences at once, each with its own KV cache: ONE decode loop
// (generate()) over any forward pass, the single-rank model's or a parallel engine rank's.
#include <cstdint>
#include <vector>

#include "model/qwen3_moe.hpp"
#include "model/sampling.hpp"

namespace fulcrum::model {

struct GenerateResult {
  std::vector<std::vector<int32_t>> new_tokens;  // per sequence: [max_new_tokens]
  std::vector<HostTensor> prompt_logits;         // per sequence: [prompt_len, vocab_size]
};

struct DecodeOptions {
  int max_new_tokens = 16;
  SamplingParams sampling;  // temperature 0 (default): greedy
  uint64_t seed = 0;        // sequence i draws from Rng(seed, "sequence i"): independent of the batch
};

// What the decode loop drives: a model that keeps per-sequence caches between forward passes.
class DecodeTarget {
 public:
  virtual ~DecodeTarget() = default;
  // Forgets every sequence and makes room for sequences of the given capacities (positions).
  virtual void reset(const std::vector<int64_t>& capacities) = 0;
  // new_tokens[i]: sequence i's new tokens -> logits [num_new_tokens, vocab_size] per sequence.
  virtual std::vector<HostTensor> forward(const std::vector<std::vector<int32_t>>& new_tokens) = 0;
};

// Index of the largest value; ties: the lowest index (like torch.argmax).
int32_t argmax(std::span<const float> values);

// Prefills every prompt in one batch, then decodes all sequences together, one token each per step,
// sampling with model::sample_token. Prompts must be non-empty. Deterministic: on parallel ranks that
// see the same logits, every rank draws the same tokens (same seed everywhere, no broadcast needed).
GenerateResult generate(DecodeTarget& target, const std::vector<std::vector<int32_t>>& prompts,
                        const DecodeOptions& options);

// generate() on a model whose stage owns the whole model, greedy.
GenerateResult generate_greedy(Qwen3MoeModel& model, Backend& backend, const std::vector<std::vector<int32_t>>& prompts,
                               int max_new_tokens, const ForwardHooks& hooks = {});

}  // namespace fulcrum::model
