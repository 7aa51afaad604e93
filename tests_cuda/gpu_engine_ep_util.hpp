#pragma once
// What the GPU engine's expert-parallel rank tests share (gpu_engine_ep_test.cpp, gpu_engine_ep_eplb_test.cpp): two
// ranks as threads on one GPU, their engine options, prompts and placements, and one batched forward's last logits.
// Tolerance: against the one-GPU engine on the same sequences, an EP rank's expert GEMMs group its rows per
// (source rank, slot) instead of per slot, so the GEMMs may sum in another order and round the expert rows to bf16
// elsewhere: the batching argument of gpu_engine_test.cpp, kEpRelTolerance = 0.01 on logits.
#include <cstdint>
#include <vector>

#include "eplb/placement.hpp"
#include "gpu/gpu_engine.hpp"
#include "gpu_engine_test_util.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {

constexpr double kEpRelTolerance = 0.01;
constexpr int kRanks = 2;

inline gpu::GpuEngineOptions ep_options() {
  gpu::GpuEngineOptions o;
  o.max_batch_tokens = 1024;
  o.max_batch_seqs = 8;
  o.kv_pages = 256;  // two engines share the GPU: no fraction of free memory
  return o;
}

// One forward_logits call over all `prompts` (sequence ids first_id, first_id + 1, ...): each prompt's last logits.
inline std::vector<std::vector<float>> last_logits_together(gpu::GpuEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                                     int64_t first_id) {
  std::vector<model::StepSequence> batch;
  for (size_t i = 0; i < prompts.size(); ++i) {
    engine.allocate(first_id + static_cast<int64_t>(i), static_cast<int64_t>(prompts[i].size()) + 8);
    batch.push_back(entry(first_id + static_cast<int64_t>(i), prompts[i], false));
  }
  const std::vector<model::HostTensor> logits = engine.forward_logits(batch);
  std::vector<std::vector<float>> out;
  const int v = engine.vocab_size();
  for (const model::HostTensor& t : logits) out.emplace_back(t.data.end() - v, t.data.end());
  for (size_t i = 0; i < prompts.size(); ++i) engine.release(first_id + static_cast<int64_t>(i));
  return out;
}

// A placement of `slots` slots over `gpus` GPUs: experts permuted per layer, the slots past E replicas of 3 experts.
inline eplb::Placement moved_placement(const model::Qwen3MoeConfig& config, int slots, int gpus) {
  const int num_moe = static_cast<int>(config.moe_layer_indices().size()), e = config.num_experts;
  eplb::Placement p(eplb::Topology{slots, gpus, 1}, num_moe, e);
  for (int l = 0; l < num_moe; ++l) {
    for (int s = 0; s < slots; ++s) p.layer(l)[static_cast<size_t>(s)] = s < e ? (s * 7 + l) % e : (s - e) % 3;
  }
  return p;
}

// Prompts of awkward lengths: rank 0 runs the first two, rank 1 the last two (a one-token prompt among them).
inline std::vector<std::vector<int32_t>> ep_prompts(int vocab) {
  return {random_tokens(300, vocab, 1), random_tokens(17, vocab, 2), random_tokens(1, vocab, 3), random_tokens(45, vocab, 4)};
}

}  // namespace fulcrum::test
