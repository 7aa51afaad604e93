#pragma once
// CPU reference of the GPU engine's paged attention over a ragged batch (gpu::AttentionBatch semantics,
// src/gpu/kernels/attention_batch.hpp): bf16 q / k / v values, fp32 scores, softmax and accumulation in position
// order, output rounded to bf16. Host spans in place of the device pointers.
#include <cstdint>
#include <span>

namespace fulcrum::gpu::reference {

struct AttentionInputs {
  std::span<const uint16_t> q;              // [T, Hq, D]
  std::span<const uint16_t> k_pool, v_pool; // [rows, Hkv, D]
  std::span<const int32_t> q_indptr;        // [S + 1]
  std::span<const int32_t> kv_page_indptr;  // [S + 1]
  std::span<const int32_t> page_ids;
  std::span<const int32_t> kv_len;          // [S]
  int num_heads = 0, num_kv_heads = 0, head_dim = 0, page_size = 0;
  float sm_scale = 0.0f;
};

// out [T, Hq, D] bf16 bits.
void paged_attention(const AttentionInputs& in, std::span<uint16_t> out);

}  // namespace fulcrum::gpu::reference
