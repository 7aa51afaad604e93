#pragma once
// The ragged batch that one attention call of the GPU engine covers, as device pointers (no CUDA header here).
// Every attention implementation (src/gpu/kernels/paged_attention.cu, the engine's own kernels; the FlashInfer
// wrappers under src/gpu/flashinfer/) takes this view; their CPU reference is gpu::reference::paged_attention.
//
// S sequences, T query tokens: sequence s owns query tokens [q_indptr[s], q_indptr[s + 1]) (n_s of them, n_s may
// be 0) and its KV pages page_ids[kv_page_indptr[s] .. kv_page_indptr[s + 1]) in position order; after this
// step's keys were appended its cache holds kv_len[s] positions, position p in pool row
// page_ids[kv_page_indptr[s] + p / page_size] * page_size + p % page_size. Query i of sequence s (0 <= i < n_s)
// sits at position kv_len[s] - n_s + i and attends causally to positions [0, kv_len[s] - n_s + i].
// Query head h reads kv head h / (num_heads / num_kv_heads). Softmax in fp32 with scale sm_scale.
#include <cstdint>

namespace fulcrum::gpu {

struct AttentionBatch {
  const uint16_t* q = nullptr;         // [T, num_heads, head_dim] bf16
  uint16_t* out = nullptr;             // [T, num_heads, head_dim] bf16
  const uint16_t* k_pool = nullptr;    // [num_pool_rows, num_kv_heads, head_dim] bf16 (NHD pages)
  const uint16_t* v_pool = nullptr;    // same shape
  const int32_t* q_indptr = nullptr;        // [S + 1]
  const int32_t* kv_page_indptr = nullptr;  // [S + 1]
  const int32_t* page_ids = nullptr;        // [kv_page_indptr[S]]
  const int32_t* kv_len = nullptr;          // [S]
  // [S * num_kv_heads] int32, zero before the launch and left zero by it: the engine's kernels count the finished
  // KV splits of each (sequence, kv head) here, and the last split merges them (FlashInfer ignores it).
  int32_t* split_counters = nullptr;
  int num_seqs = 0;
  int num_tokens = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int page_size = 0;
  float sm_scale = 0.0f;
};

}  // namespace fulcrum::gpu
