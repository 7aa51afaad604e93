#pragma once
// Paged attention over one ragged batch (gpu::AttentionBatch semantics, src/gpu/kernels/attention_batch.hpp;
// CPU reference gpu::reference::paged_attention) through FlashInfer 0.7.2, head_dim 128, on an sm_90 GPU.
// Two kernels, chosen per batch by plan():
//   decode   every sequence has exactly one query token: FlashInfer's tensor-core decode (the FA2 batch-prefill
//            kernel with the GQA group's heads packed into a 16-row query tile, MaskMode::kNone), split-KV + merge
//            when FlashInfer's plan splits long contexts;
//   prefill  anything else (prefill chunks, mixed with decode tokens): FlashInfer's SM90 causal kernel. Its mask
//            puts query i of a sequence with n queries and kv_len L at position L - n + i, as AttentionBatch does.
// Both read the KV pool in place through the batch's page list (NHD pages: row page * page_size + offset).
//
// Per step: plan() on the host with host copies of the batch's q_indptr / kv_page_indptr / kv_len, then run() once
// per layer (all layers share the plan; only q, out and the pools change). plan() computes FlashInfer's schedule on
// the host and enqueues one host-to-device copy of it (pinned memory) on `stream`; run() only enqueues kernels.
// plan() is never captured; run() may be, after a plan with for_cuda_graph = true: FlashInfer's CUDA-graph mode,
// whose launch layout (grid, workspace offsets) depends only on (num_seqs, num_tokens, kernel). Before each replay,
// re-plan with the step's lengths and the same num_seqs / num_tokens / kernel (a layout change throws), with the
// batch metadata written into the same device buffers the captured run() read.
//
// Spare pages: a sequence may own more pages than ceil(kv_len / page_size); the extra ones are not read.
// Requirements checked by plan(): q_indptr[0] == 0, 0 <= q len <= kv_len, enough pages, num_seqs <= max_seqs,
// num_tokens <= max_tokens. Errors throw fulcrum::Error with one line.
//
// Stream and device: one stream for plan() and run() (the schedule's upload must precede the kernels that read
// it); device_idx must be the calling thread's current device. plan() waits (host) for the previous plan's upload
// to finish before it rewrites the pinned buffer: a no-op unless the host runs ahead of the stream by two plans.
//
// This header includes no CUDA header; device pointers are plain pointers (bf16 as uint16_t bits).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "gpu/kernels/attention_batch.hpp"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace fulcrum::gpu {

class FlashInferAttention {
 public:
  enum class Kernel { kNone, kDecode, kPrefill };  // kNone: an empty batch (no query token), run() does nothing

  // Allocates the device workspaces (FlashInfer's float and int buffers, the last-page-length array) and the pinned
  // host mirror of the int buffer, sized for up to max_tokens query tokens and max_seqs sequences per batch.
  FlashInferAttention(int num_heads, int num_kv_heads, int head_dim, int page_size, int max_tokens, int max_seqs,
                      int device_idx = 0);
  ~FlashInferAttention();
  FlashInferAttention(const FlashInferAttention&) = delete;
  FlashInferAttention& operator=(const FlashInferAttention&) = delete;

  // head_dim 128 and a GQA group (num_heads / num_kv_heads) of 1, 2, 4, 8 or 16. The group is a runtime value of
  // both kernels (no instantiation per group); the tests cover groups 1, 4, 8 and 16.
  static bool supports(int head_dim, int num_heads, int num_kv_heads);

  // Host copies of the batch: q_indptr [S + 1], kv_page_indptr [S + 1], kv_len [S].
  void plan(std::span<const int32_t> q_indptr, std::span<const int32_t> kv_page_indptr,
            std::span<const int32_t> kv_len, bool for_cuda_graph, CUstream_st* stream);
  // Enqueues the planned kernel on `stream` for `batch`, which must describe the planned batch (same S, T and
  // shape; its device metadata equal to the host copies given to plan()).
  void run(const AttentionBatch& batch, CUstream_st* stream);

  // After the graph that captured run() is destroyed: the next for_cuda_graph plan may have other sizes (until a
  // run() under capture records them again). One object serves one captured graph at a time.
  void release_captured_graph();

  Kernel planned_kernel() const;
  size_t device_workspace_bytes() const;  // float + int + last-page-length buffers
  size_t pinned_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fulcrum::gpu
