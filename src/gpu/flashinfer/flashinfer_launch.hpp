#pragma once
// The thin layer between FlashInferAttention (src/gpu/flashinfer_attention.cpp, host compiler) and the FlashInfer
// 0.7.2 headers (the .cu files beside this one, nvcc with the FlashInfer include paths). Plain functions that
// return a cudaError_t and, when FlashInfer refused (it throws flashinfer::Error), its message in *error: no
// exception crosses this boundary and no FlashInfer type appears in it. A plan is FlashInfer's plan-info struct
// as its ToVector() (PrefillPlanInfo: 15 values; PrefillPlanSM90Info: 9), offsets into the workspace buffers.
//
// Instantiations (each costs minutes of build on 2 cores, so exactly these):
//   fa2_decode.cu    FA2 batch prefill over paged KV, CTA_TILE_Q 16, head_dim 128, MaskMode::kNone, bf16, int32
//                    ids: FlashInfer's "tensor-core decode" (one query per sequence, the GQA group's heads packed
//                    into the query tile), plus its split-KV merge.
//   sm90_prefill.cu  SM90 (TMA / wgmma) batch prefill over paged KV, head_dim 128, causal, bf16, int32 ids,
//                    per-head schedule (SAME_SCHEDULE_FOR_ALL_HEADS = false).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/kernels/attention_batch.hpp"

namespace fulcrum::gpu::flashinfer_launch {

constexpr int kHeadDim = 128;
constexpr int kDecodeCtaTileQ = 16;  // the one FA2 query tile instantiated (FlashInfer picks it for packed q <= 16)
// The SM90 plan switches to one schedule for all heads above this many query tiles per head; that variant is
// not instantiated, so FlashInferAttention bounds ceil(max_tokens / 128) + max_seqs - 1 by it.
constexpr int kSm90MaxWorksPerHead = 4096;
constexpr int kSm90CtaTileQ = 128;

// FlashInfer's buffers: float (split-KV partial outputs, FA2 only), int (the plan's schedule on the device) and
// its pinned host mirror (written by the plan, copied to int_buffer by one cudaMemcpyAsync on the plan's stream).
struct Workspace {
  void* float_buffer = nullptr;
  size_t float_bytes = 0;
  void* int_buffer = nullptr;
  void* int_pinned = nullptr;
  size_t int_bytes = 0;
};

// FA2 decode plan: every sequence has exactly one query (q_indptr_h[s] = s); kv_page_count_indptr_h holds the
// prefix sums of ceil(kv_len / page_size) (the pages the kernel reads; spare pages are not counted). Host
// arrays of num_seqs + 1 values (FlashInfer's plan takes them as non-const). Enqueues the workspace upload.
cudaError_t plan_decode(const Workspace& ws, int32_t* q_indptr_h, int32_t* kv_page_count_indptr_h, int num_seqs,
                        int num_heads, int num_kv_heads, int page_size, bool cuda_graph, cudaStream_t stream,
                        std::vector<int64_t>* plan, std::string* error);
// Enqueues the FA2 kernel (+ the split-KV merge when the plan split). FlashInfer's paged_kv_t reads a sequence's
// pages from batch.kv_page_indptr / page_ids and its length as (pages - 1) * page_size + last_page_len[s]
// (device [num_seqs], written by the caller's plan).
cudaError_t run_decode(const Workspace& ws, const std::vector<int64_t>& plan, const AttentionBatch& batch,
                       const int32_t* last_page_len, cudaStream_t stream, std::string* error);

// SM90 causal prefill plan over the batch's own host metadata (num_seqs + 1 / num_seqs values). Enqueues the upload.
cudaError_t plan_prefill(const Workspace& ws, int32_t* q_indptr_h, int32_t* kv_page_indptr_h, int32_t* kv_len_h,
                         int num_seqs, int num_tokens, int num_heads, int num_kv_heads, int page_size,
                         bool cuda_graph, cudaStream_t stream, std::vector<int64_t>* plan, std::string* error);
cudaError_t run_prefill(const Workspace& ws, const std::vector<int64_t>& plan, const AttentionBatch& batch,
                        cudaStream_t stream, std::string* error);

}  // namespace fulcrum::gpu::flashinfer_launch
