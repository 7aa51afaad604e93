// FlashInfer's SM90 (TMA / wgmma) causal prefill over paged KV: PrefillSM90Plan + BatchPrefillWithPagedKVCacheDispatched
// with the persistent per-head scheduler, as the kernel probe ran it on an H200
// (../shared/examples/kernel-probe/fi_prefill.cu). The causal mask is bottom-right aligned: query i of a sequence with
// qo_len n and kv_len L sees keys [0, L - n + i] (mainloop_mma.cuh: col_limit_right = qo_idx + 1 + kv_len - qo_len),
// which is gpu::AttentionBatch's convention. See flashinfer_launch.hpp.
// FlashInfer's SM90 mainloop captures structured bindings in lambdas (C++20; nvcc accepts it in C++17 with a warning).
#pragma nv_diag_suppress 3357
#include <flashinfer/attention/hopper/default_params.cuh>
#include <flashinfer/attention/hopper/prefill_sm90.cuh>
#include <flashinfer/attention/hopper/variants.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/cutlass_utils.cuh>

#include <exception>

#include "gpu/flashinfer/flashinfer_launch.hpp"

namespace fulcrum::gpu::flashinfer_launch {
namespace {

using Bf16 = cutlass::bfloat16_t;
using Params = flashinfer::BatchPrefillPagedParams<Bf16, Bf16, Bf16, int32_t>;
using Variant = flashinfer::StandardAttention;  // softmax, no soft cap

template <typename T>
T* mutable_ptr(const T* p) {
  return const_cast<T*>(p);  // FlashInfer's params hold non-const pointers; it only reads q, k and v
}

}  // namespace

cudaError_t plan_prefill(const Workspace& ws, int32_t* q_indptr_h, int32_t* kv_page_indptr_h, int32_t* kv_len_h,
                         int num_seqs, int num_tokens, int num_heads, int num_kv_heads, int page_size,
                         bool cuda_graph, cudaStream_t stream, std::vector<int64_t>* plan, std::string* error) {
  try {
    flashinfer::PrefillPlanSM90Info info;
    const cudaError_t status = flashinfer::PrefillSM90Plan<int32_t>(
        ws.float_buffer, ws.float_bytes, ws.int_buffer, ws.int_pinned, ws.int_bytes, info, q_indptr_h,
        kv_page_indptr_h, kv_len_h, /*total_num_rows=*/num_tokens, num_seqs, num_heads, num_kv_heads, kHeadDim,
        kHeadDim, page_size, /*causal=*/true, cuda_graph, /*sizeof_dtype_o=*/2, stream);
    if (status != cudaSuccess) return status;
    if (info.same_schedule_for_all_heads) {
      *error = "FlashInfer's SM90 plan chose one schedule for all heads (more than " +
               std::to_string(kSm90MaxWorksPerHead) + " query tiles per head), which is not instantiated";
      return cudaErrorNotSupported;
    }
    *plan = info.ToVector();
    return cudaSuccess;
  } catch (const std::exception& e) {
    *error = e.what();
    return cudaErrorInvalidValue;
  }
}

cudaError_t run_prefill(const Workspace& ws, const std::vector<int64_t>& plan, const AttentionBatch& batch,
                        cudaStream_t stream, std::string* error) {
  try {
    flashinfer::PrefillPlanSM90Info info;
    info.FromVector(plan);
    if (info.same_schedule_for_all_heads) return cudaErrorNotSupported;
    Params p{};
    p.q_ptr = reinterpret_cast<Bf16*>(mutable_ptr(batch.q));
    p.k_ptr = reinterpret_cast<Bf16*>(mutable_ptr(batch.k_pool));
    p.v_ptr = reinterpret_cast<Bf16*>(mutable_ptr(batch.v_pool));
    p.o_ptr = reinterpret_cast<Bf16*>(batch.out);
    p.lse_ptr = nullptr;
    // q / out [T, Hq, D]; pools [num_pages, page_size, Hkv, D] (NHD): row stride Hkv * D, page stride page_size rows.
    p.q_stride_n = int64_t{batch.num_heads} * kHeadDim;
    p.q_stride_h = kHeadDim;
    p.o_stride_n = p.q_stride_n;
    p.o_stride_h = kHeadDim;
    p.k_stride_n = int64_t{batch.num_kv_heads} * kHeadDim;
    p.k_stride_h = kHeadDim;
    p.v_stride_n = p.k_stride_n;
    p.v_stride_h = kHeadDim;
    p.k_page_stride = int64_t{batch.page_size} * p.k_stride_n;
    p.v_page_stride = p.k_page_stride;
    p.nnz_qo = batch.num_tokens;
    p.num_qo_heads = batch.num_heads;
    p.num_kv_heads = batch.num_kv_heads;
    p.group_size = batch.num_heads / batch.num_kv_heads;
    p.page_size = batch.page_size;
    p.window_left = -1;
    p.causal = true;
    p.kv_indices = mutable_ptr(batch.page_ids);
    p.additional_params.logits_soft_cap = 0.0f;
    p.additional_params.sm_scale = batch.sm_scale;
    p.additional_params.maybe_prefix_len_ptr = nullptr;
    p.additional_params.maybe_token_pos_in_items_ptr = nullptr;
    p.additional_params.token_pos_in_items_len = 0;
    p.additional_params.maybe_max_item_len_ptr = nullptr;
    // The plan's per-CTA work lists (query / KV offsets, lengths, heads) live in the int workspace: the kernel
    // reads lengths and page offsets from there, not from batch.q_indptr / kv_len / kv_page_indptr.
    const auto int_ptr = [&](int64_t offset) { return flashinfer::GetPtrFromBaseOffset<int32_t>(ws.int_buffer, offset); };
    p.qo_tile_indices = int_ptr(info.qo_tile_indices_offset);
    p.qo_indptr = int_ptr(info.qo_indptr_offset);
    p.kv_indptr = int_ptr(info.kv_indptr_offset);
    p.qo_lens = int_ptr(info.qo_len_offset);
    p.kv_lens = int_ptr(info.kv_len_offset);
    p.head_indices = int_ptr(info.head_indices_offset);
    p.work_indptr = int_ptr(info.work_indptr_offset);
    p.batch_indices = int_ptr(info.batch_indices_offset);

    const cudaError_t status =
        flashinfer::BatchPrefillWithPagedKVCacheDispatched<kHeadDim, kHeadDim, flashinfer::MaskMode::kCausal,
                                                           /*LEFT_SLIDING_WINDOW=*/false,
                                                           /*SAME_SCHEDULE_FOR_ALL_HEADS=*/false, Variant, Params>(
            p, /*enable_pdl=*/false, stream);
    if (status != cudaSuccess) return status;
    return cudaGetLastError();
  } catch (const std::exception& e) {
    *error = e.what();
    return cudaErrorInvalidValue;
  }
}

}  // namespace fulcrum::gpu::flashinfer_launch
