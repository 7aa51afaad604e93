// FlashInfer's tensor-core decode: the FA2 batch-prefill kernel over paged KV run with one query per sequence
// (PrefillPlan + BatchPrefillWithPagedKVCacheDispatched, MaskMode::kNone: the one query sits at the last position
// and sees every key). The call sequence is the one the kernel probe ran on an H200
// (../shared/examples/kernel-probe/fi_decode_tc.cu). See flashinfer_launch.hpp.
#include <flashinfer/attention/default_prefill_params.cuh>
#include <flashinfer/attention/prefill.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/attention/variants.cuh>
#include <flashinfer/page.cuh>

#include <exception>

#include "gpu/flashinfer/flashinfer_launch.hpp"

namespace fulcrum::gpu::flashinfer_launch {
namespace {

using Bf16 = __nv_bfloat16;
using Params = flashinfer::BatchPrefillPagedParams<Bf16, Bf16, Bf16, int32_t>;
using Variant = flashinfer::DefaultAttention</*custom_mask=*/false, /*sliding_window=*/false,
                                             /*logits_soft_cap=*/false, /*alibi=*/false>;

template <typename T>
T* mutable_ptr(const T* p) {
  return const_cast<T*>(p);  // FlashInfer's params hold non-const pointers; it only reads q, k and v
}

}  // namespace

cudaError_t plan_decode(const Workspace& ws, int32_t* q_indptr_h, int32_t* kv_page_count_indptr_h, int num_seqs,
                        int num_heads, int num_kv_heads, int page_size, bool cuda_graph, cudaStream_t stream,
                        std::vector<int64_t>* plan, std::string* error) {
  try {
    flashinfer::PrefillPlanInfo info;
    // total_num_rows = num_seqs (one query each); uniform_q_len 1 sizes the CUDA-graph layout for exactly that
    // (the plan checks it); split-KV chosen by FlashInfer (always on in CUDA-graph mode).
    const cudaError_t status = flashinfer::PrefillPlan<int32_t>(
        ws.float_buffer, ws.float_bytes, ws.int_buffer, ws.int_pinned, ws.int_bytes, info, q_indptr_h,
        kv_page_count_indptr_h, /*total_num_rows=*/num_seqs, num_seqs, num_heads, num_kv_heads, kHeadDim, kHeadDim,
        page_size, cuda_graph, /*sizeof_dtype_o=*/2, /*window_left=*/-1, /*fixed_split_size=*/-1,
        /*disable_split_kv=*/false, /*num_colocated_ctas=*/0, /*uniform_q_len=*/1, stream, /*kv_dtype_bytes=*/2);
    if (status != cudaSuccess) return status;
    if (info.cta_tile_q != kDecodeCtaTileQ) {
      *error = "FlashInfer's decode plan chose cta_tile_q " + std::to_string(info.cta_tile_q) +
               ", only " + std::to_string(kDecodeCtaTileQ) + " is instantiated";
      return cudaErrorNotSupported;
    }
    *plan = info.ToVector();
    return cudaSuccess;
  } catch (const std::exception& e) {
    *error = e.what();
    return cudaErrorInvalidValue;
  }
}

cudaError_t run_decode(const Workspace& ws, const std::vector<int64_t>& plan, const AttentionBatch& batch,
                       const int32_t* last_page_len, cudaStream_t stream, std::string* error) {
  try {
    flashinfer::PrefillPlanInfo info;
    info.FromVector(plan);
    // NHD pages: [num_pages, page_size, num_kv_heads, head_dim], i.e. pool row page * page_size + offset.
    flashinfer::paged_kv_t<Bf16, int32_t> paged_kv(
        batch.num_kv_heads, batch.page_size, kHeadDim, batch.num_seqs, flashinfer::QKVLayout::kNHD,
        reinterpret_cast<Bf16*>(mutable_ptr(batch.k_pool)), reinterpret_cast<Bf16*>(mutable_ptr(batch.v_pool)),
        mutable_ptr(batch.page_ids), mutable_ptr(batch.kv_page_indptr), mutable_ptr(last_page_len));
    Params params(reinterpret_cast<Bf16*>(mutable_ptr(batch.q)), paged_kv, /*custom_mask=*/nullptr,
                  mutable_ptr(batch.q_indptr), /*mask_indptr=*/nullptr, /*q_rope_offset=*/nullptr,
                  reinterpret_cast<Bf16*>(batch.out), /*lse=*/nullptr, /*alibi_slopes=*/nullptr, batch.num_heads,
                  /*q_stride_n=*/batch.num_heads * kHeadDim, /*q_stride_h=*/kHeadDim, /*window_left=*/-1,
                  /*logits_soft_cap=*/0.0f, batch.sm_scale, /*rope_scale=*/1.0f, /*rope_theta=*/1e4f);

    // The plan's schedule, as FlashInfer's own binding (csrc/batch_prefill_paged.cuh) reads it.
    const auto int_ptr = [&](int64_t offset) { return flashinfer::GetPtrFromBaseOffset<int32_t>(ws.int_buffer, offset); };
    params.request_indices = int_ptr(info.request_indices_offset);
    params.qo_tile_indices = int_ptr(info.qo_tile_indices_offset);
    params.kv_tile_indices = int_ptr(info.kv_tile_indices_offset);
    params.o_indptr = int_ptr(info.o_indptr_offset);
    params.kv_chunk_size_ptr = int_ptr(info.kv_chunk_size_ptr_offset);
    params.merge_indptr = nullptr;
    Bf16* tmp_v = nullptr;  // split-KV partial outputs (null: one pass, no merge)
    float* tmp_s = nullptr;
    if (info.split_kv) {
      params.merge_indptr = int_ptr(info.merge_indptr_offset);
      tmp_v = flashinfer::GetPtrFromBaseOffset<Bf16>(ws.float_buffer, info.v_offset);
      tmp_s = flashinfer::GetPtrFromBaseOffset<float>(ws.float_buffer, info.s_offset);
    }
    params.padded_batch_size = info.padded_batch_size;
    params.max_total_num_rows = info.total_num_rows;
    params.block_valid_mask = nullptr;
    params.total_num_rows = nullptr;
    if (info.enable_cuda_graph) {  // fixed grid: padding CTAs masked off, merge row count read from the device
      params.block_valid_mask = flashinfer::GetPtrFromBaseOffset<bool>(ws.int_buffer, info.block_valid_mask_offset);
      params.total_num_rows = flashinfer::GetPtrFromBaseOffset<uint32_t>(ws.int_buffer, info.total_num_rows_offset);
    }
    params.partition_kv = false;  // the dispatcher sets it from tmp_v

    if (info.cta_tile_q != kDecodeCtaTileQ) return cudaErrorNotSupported;
    const cudaError_t status = flashinfer::BatchPrefillWithPagedKVCacheDispatched<
        /*SAME_KV_STRIDES=*/true, kDecodeCtaTileQ, kHeadDim, kHeadDim, flashinfer::PosEncodingMode::kNone,
        /*USE_FP16_QK_REDUCTION=*/false, flashinfer::MaskMode::kNone, Variant, Params>(params, tmp_v, tmp_s,
                                                                                     /*enable_pdl=*/false, stream);
    if (status != cudaSuccess) return status;
    return cudaGetLastError();
  } catch (const std::exception& e) {
    *error = e.what();
    return cudaErrorInvalidValue;
  }
}

}  // namespace fulcrum::gpu::flashinfer_launch
