#pragma once
// Raw-pointer launchers of the CUDA backend's kernels. Each enqueues its work on `stream` and returns
// the launch status (cudaGetLastError), which the caller checks with FULCRUM_CUDA_CHECK. Sizes are
// validated by the caller (cuda_backend.cpp); every launcher accepts zero-sized work and does nothing.
// All pointers are device pointers; tensors are dense row-major fp32.
#include <cstdint>

#include <cuda_runtime.h>

namespace fulcrum::cuda {

// out[i] = x[row_idx[i]] for i < num_out_rows, rows of `width` floats.
cudaError_t launch_gather_rows(const float* x, const int32_t* row_idx, float* out, int64_t num_out_rows, int64_t width,
                               cudaStream_t stream);
// dst[row_idx[i]] = src[i] for i < num_src_rows (indices must be distinct for a defined result).
cudaError_t launch_scatter_rows(float* dst, const float* src, const int32_t* row_idx, int64_t num_src_rows,
                                int64_t width, cudaStream_t stream);
// gate_up [num_rows, 2 * width] -> out [num_rows, width] = silu(gate) * up.
cudaError_t launch_silu_mul(const float* gate_up, float* out, int64_t num_rows, int64_t width, cudaStream_t stream);
// x[i] += y[i], i < n.
cudaError_t launch_add_inplace(float* x, const float* y, int64_t n, cudaStream_t stream);
// out [num_tokens, dim] = sum_j weights[t * k + j] * rows[t * k + j], j in order from zero.
cudaError_t launch_weighted_sum(const float* rows, const float* weights, float* out, int64_t num_tokens, int k,
                                int64_t dim, cudaStream_t stream);

// out [num_rows, dim] = x * rsqrt(mean(x^2) + eps) * weight [dim] (sum of squares in double, as the CPU).
cudaError_t launch_rms_norm(const float* x, const float* weight, float* out, int64_t num_rows, int64_t dim, float eps,
                            cudaStream_t stream);
// x [num_tokens, num_heads, head_dim] rotated in place (HF rotate_half) by the per-token tables
// cos_sin [num_tokens, 2, head_dim / 2] (cos row then sin row).
cudaError_t launch_rope(float* x, const float* cos_sin, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                        cudaStream_t stream);

// Bytes of shared memory (dynamic plus static) the attention kernel needs for a query seeing `num_keys` keys.
size_t attention_shared_bytes(int64_t head_dim, int64_t num_keys);
// Causal GQA of one sequence over a paged pool: q [num_tokens, num_heads, head_dim]; pools [num_pool_rows,
// num_kv_heads, head_dim]; position p is pool row page_ids[p / page_size] * page_size + p % page_size
// (page_ids: device array covering positions [0, start_pos + num_tokens)); query t sees positions
// [0, start_pos + t]; out [num_tokens, num_heads * head_dim].
cudaError_t launch_paged_attention(const float* q, const float* k_pool, const float* v_pool, const int32_t* page_ids,
                                   int64_t page_size, float* out, int64_t num_tokens, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t start_pos, cudaStream_t stream);

// Most experts launch_route handles (its probabilities live in shared memory without an opt-in).
constexpr int kMaxRouteExperts = 8192;
// Per token: softmax of router_logits [num_tokens, num_experts] (double accumulation, fp32 probabilities),
// top-k by descending probability (ties: lower expert index first), optional renormalization (fp32 sum in
// j order). expert_ids and weights are [num_tokens, top_k].
cudaError_t launch_route(const float* router_logits, int32_t* expert_ids, float* weights, int64_t num_tokens,
                         int num_experts, int top_k, bool norm_topk_prob, cudaStream_t stream);

}  // namespace fulcrum::cuda
