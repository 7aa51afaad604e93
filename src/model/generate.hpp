#pragma once
// Greedy decoding of several sequences at once, each with its own KV cache.
#include <cstdint>
#include <vector>

#include "model/qwen3_moe.hpp"

namespace fulcrum::model {

struct GenerateResult {
  std::vector<std::vector<int32_t>> new_tokens;  // per sequence: [max_new_tokens]
  std::vector<HostTensor> prompt_logits;         // per sequence: [prompt_len, vocab_size]
};

// Index of the largest value; ties: the lowest index (like torch.argmax).
int32_t argmax(std::span<const float> values);

// Prefills every prompt in one batch, then decodes all sequences together, one token each per step.
// The stage must own the whole model. Prompts must be non-empty.
GenerateResult generate_greedy(Qwen3MoeModel& model, Backend& backend, const std::vector<std::vector<int32_t>>& prompts,
                               int max_new_tokens, const ForwardHooks& hooks = {});

}  // namespace fulcrum::model
