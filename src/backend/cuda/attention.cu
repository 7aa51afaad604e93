// Causal grouped-query attention, correctness first: one block per (query token, head). The block keeps
// the query and all of its scores in shared memory (so the key count is bounded by the shared memory a
// block may opt into: about 56K keys on an H100/H200), computes the scores one warp per key, the softmax
// in fp32 (max subtracted), then one thread per output dimension accumulates the values in key order.
// Keys and values are read through a page table; the order of every sum is that of the positions, so
// any page layout gives the same bits.
#include <cmath>

#include "backend/cuda/kernels.hpp"
#include "backend/cuda/launch_util.cuh"

namespace fulcrum::cuda {
namespace {

constexpr int kAttentionThreads = 128;
constexpr size_t kDefaultSharedBytes = 48 * 1024;

// Pool row of position `pos`.
__device__ __forceinline__ int64_t pool_row(const int32_t* page_ids, int64_t page_size, int64_t pos) {
  return static_cast<int64_t>(page_ids[pos / page_size]) * page_size + pos % page_size;
}

__global__ void attention_kernel(const float* q, const float* k_pool, const float* v_pool, const int32_t* page_ids,
                                 int64_t page_size, float* out, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t start_pos, float scale) {
  extern __shared__ float smem[];
  __shared__ float scratch[32];
  float* q_s = smem;                // [head_dim]
  float* scores = smem + head_dim;  // [num_keys]
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int64_t kv_h = h / (num_heads / num_kv_heads);
  const int64_t num_keys = start_pos + t + 1;  // causal: keys at positions <= this query's
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;

  const float* qv = q + (t * num_heads + h) * head_dim;
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = qv[d];
  __syncthreads();

  for (int64_t j = warp; j < num_keys; j += num_warps) {
    const float* kv = k_pool + (pool_row(page_ids, page_size, j) * num_kv_heads + kv_h) * head_dim;
    float dot = 0.0f;
    for (int64_t d = lane; d < head_dim; d += 32) dot += q_s[d] * kv[d];
    dot = warp_sum(dot);
    if (lane == 0) scores[j] = dot * scale;
  }
  __syncthreads();

  float max_score = -INFINITY;
  for (int64_t j = threadIdx.x; j < num_keys; j += blockDim.x) max_score = fmaxf(max_score, scores[j]);
  max_score = block_max(max_score, scratch, -INFINITY);
  float denom = 0.0f;
  for (int64_t j = threadIdx.x; j < num_keys; j += blockDim.x) {
    const float e = expf(scores[j] - max_score);
    scores[j] = e;
    denom += e;
  }
  denom = block_sum(denom, scratch);  // also makes every thread's exponentials visible to the block
  const float inv_denom = 1.0f / denom;

  float* o = out + (t * num_heads + h) * head_dim;
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int64_t page_start = 0; page_start < num_keys; page_start += page_size) {  // page by page, in order
      const float* page = v_pool + (static_cast<int64_t>(page_ids[page_start / page_size]) * page_size * num_kv_heads +
                                    kv_h) * head_dim + d;
      const int64_t page_end = min(num_keys, page_start + page_size);
      for (int64_t j = page_start; j < page_end; ++j) acc += scores[j] * page[(j - page_start) * num_kv_heads * head_dim];
    }
    o[d] = acc * inv_denom;
  }
}


constexpr size_t kStaticSharedBytes = 32 * sizeof(float);  // attention_kernel's reduction scratch

// Dynamic shared memory: the query and the scores.
size_t dynamic_shared_bytes(int64_t head_dim, int64_t num_keys) {
  return static_cast<size_t>(head_dim + num_keys) * sizeof(float);
}

}  // namespace

size_t attention_shared_bytes(int64_t head_dim, int64_t num_keys) {
  return dynamic_shared_bytes(head_dim, num_keys) + kStaticSharedBytes;
}

cudaError_t launch_paged_attention(const float* q, const float* k_pool, const float* v_pool, const int32_t* page_ids,
                                   int64_t page_size, float* out, int64_t num_tokens, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t start_pos, cudaStream_t stream) {
  if (num_tokens == 0 || num_heads == 0 || head_dim == 0) return cudaSuccess;
  const size_t shared_bytes = dynamic_shared_bytes(head_dim, start_pos + num_tokens);
  if (shared_bytes + kStaticSharedBytes > kDefaultSharedBytes) {
    const cudaError_t status = cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(shared_bytes));
    if (status != cudaSuccess) return status;
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  const dim3 grid(static_cast<unsigned int>(num_tokens), static_cast<unsigned int>(num_heads));
  attention_kernel<<<grid, kAttentionThreads, shared_bytes, stream>>>(
      q, k_pool, v_pool, page_ids, page_size, out, num_heads, num_kv_heads, head_dim, start_pos, scale);
  return cudaGetLastError();
}

}  // namespace fulcrum::cuda
