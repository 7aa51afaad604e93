#pragma once
// `fulcrum generate --device cuda` on one GPU: the decode loop of model::generate over the GPU engine's step.
// Prompts are prefilled in chunks of the engine's step capacity, then every sequence decodes one token a step
// (CUDA-graph replays). Sequence i draws from Rng(seed, "sequence i"), one uniform per sampled token when
// temperature > 0, as model::generate, so a seed gives the CPU engine's tokens up to the numerics.
#include <cstdint>
#include <functional>
#include <vector>

#include "gpu/gpu_engine.hpp"
#include "model/generate.hpp"

namespace fulcrum::gpu {

struct GpuGenerateStats {
  double prefill_seconds = 0;
  double decode_seconds = 0;
  int64_t decode_steps = 0;
};

// One expert-parallel rank of a lockstep run (GpuEngineOptions::ep): every rank must take as many steps as the
// others, so a rank past its own prefill takes empty steps up to `prefill_steps` (the most any rank's prompts take:
// gpu_prefill_steps), and a rank without prompts takes empty decode steps too. `sequence_index`: each prompt's
// index in the whole run, whose Rng stream ("sequence i") it draws from, so the ranks sample what one engine would.
// after_step, when set, runs after each step (prefill and decode, the empty ones too): the ranks' live EPLB
// (GpuRankEplb::after_step), at the same step on every rank.
struct GpuGenerateRank {
  std::vector<size_t> sequence_index;
  int64_t prefill_steps = 0;
  std::function<void()> after_step;
};

// With `prompt_logits`, the prefill returns every prompt position's logits (result.prompt_logits) and the
// first token is sampled on the host from them; otherwise the device samples and prompt_logits stay empty.
model::GenerateResult gpu_generate(GpuEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                   const model::DecodeOptions& options, bool prompt_logits, GpuGenerateStats* stats = nullptr,
                                   const GpuGenerateRank* rank = nullptr);

// The prefill steps gpu_generate takes for `prompts` on an engine of this step capacity.
int64_t gpu_prefill_steps(const std::vector<std::vector<int32_t>>& prompts, int64_t max_batch_tokens, int max_batch_seqs);

}  // namespace fulcrum::gpu
