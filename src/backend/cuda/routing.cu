// Router: softmax and top-k per token, one block per token. The softmax follows the CPU reference
// (max in fp32, exponentials and their sum in double, probabilities rounded to fp32), so the chosen experts
// and their weights match it except where two probabilities differ only in the last bit.
#include <climits>
#include <cmath>

#include "backend/cuda/kernels.hpp"
#include "backend/cuda/launch_util.cuh"

namespace fulcrum::cuda {
namespace {

constexpr int kRouteThreads = 128;

// Descending probability; equal probabilities: lower expert index first.
__device__ bool ranks_before(float p, int e, float other_p, int other_e) {
  return p != other_p ? p > other_p : e < other_e;
}

__global__ void route_kernel(const float* router_logits, int32_t* expert_ids, float* weights, int num_experts,
                             int top_k, bool norm_topk_prob) {
  extern __shared__ float probs[];  // [num_experts]; a chosen expert's entry becomes -1
  __shared__ float float_scratch[32];
  __shared__ double double_scratch[32];
  __shared__ float best_p[32];
  __shared__ int best_e[32];
  const int64_t t = blockIdx.x;
  const float* logits = router_logits + t * num_experts;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;

  float max_logit = -INFINITY;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) max_logit = fmaxf(max_logit, logits[e]);
  max_logit = block_max(max_logit, float_scratch, -INFINITY);
  double denom = 0;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) denom += exp(static_cast<double>(logits[e]) - max_logit);
  denom = block_sum(denom, double_scratch);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    probs[e] = static_cast<float>(exp(static_cast<double>(logits[e]) - max_logit) / denom);
  }
  __syncthreads();

  for (int j = 0; j < top_k; ++j) {
    float p = -1.0f;
    int e_best = INT_MAX;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
      if (probs[e] >= 0.0f && ranks_before(probs[e], e, p, e_best)) {
        p = probs[e];
        e_best = e;
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other_p = __shfl_xor_sync(0xffffffffu, p, offset);
      const int other_e = __shfl_xor_sync(0xffffffffu, e_best, offset);
      if (ranks_before(other_p, other_e, p, e_best)) {
        p = other_p;
        e_best = other_e;
      }
    }
    if (lane == 0) {
      best_p[warp] = p;
      best_e[warp] = e_best;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < num_warps; ++w) {
        if (ranks_before(best_p[w], best_e[w], p, e_best)) {
          p = best_p[w];
          e_best = best_e[w];
        }
      }
      expert_ids[t * top_k + j] = e_best;
      weights[t * top_k + j] = p;
      probs[e_best] = -1.0f;
    }
    __syncthreads();
  }

  if (threadIdx.x == 0 && norm_topk_prob) {
    float sum = 0.0f;
    for (int j = 0; j < top_k; ++j) sum += weights[t * top_k + j];
    for (int j = 0; j < top_k; ++j) weights[t * top_k + j] = weights[t * top_k + j] / sum;
  }
}

}  // namespace

cudaError_t launch_route(const float* router_logits, int32_t* expert_ids, float* weights, int64_t num_tokens,
                         int num_experts, int top_k, bool norm_topk_prob, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const size_t shared_bytes = static_cast<size_t>(num_experts) * sizeof(float);
  route_kernel<<<static_cast<unsigned int>(num_tokens), kRouteThreads, shared_bytes, stream>>>(
      router_logits, expert_ids, weights, num_experts, top_k, norm_topk_prob);
  return cudaGetLastError();
}

}  // namespace fulcrum::cuda
