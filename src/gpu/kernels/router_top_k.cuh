#pragma once
// One token's router choice by one warp: softmax of its logits (double exponentials and sum, fp32 probabilities,
// as CpuBackend::route), then top-k by k warp-wide argmax rounds (ties to the lower expert, as the CPU's sort).
// Shared by the MoE layer's router kernels (gpu/moe/moe_kernels.cu) and the expert gate_up / down GEMMs that route
// a one-token step themselves (expert_skinny_gemm.cu), so both choose the same experts with the same bits.
#include <cmath>

#include "backend/cuda/launch_util.cuh"  // warp_max, warp_sum

namespace fulcrum::gpu {

// Lane `lane` ends with my_expert / my_prob of choice j == lane (j < top_k; -1 / 0 elsewhere) and every lane with
// sum, the chosen probabilities added in j order. E <= 32 * kLogitsPerLane, top_k <= kMaxK.
template <int kLogitsPerLane, int kMaxK>
__device__ __forceinline__ void warp_softmax_top_k(const float* row, int num_experts, int top_k, int lane,
                                                   float& my_prob, int& my_expert, float& sum) {
  float logit[kLogitsPerLane];
  float max_logit = -INFINITY;
#pragma unroll
  for (int i = 0; i < kLogitsPerLane; ++i) {
    const int e = lane + 32 * i;
    logit[i] = e < num_experts ? row[e] : -INFINITY;
    max_logit = fmaxf(max_logit, logit[i]);
  }
  max_logit = cuda::warp_max(max_logit);
  double denom = 0.0, ex[kLogitsPerLane];  // each exponential computed once (double: a long instruction sequence)
#pragma unroll
  for (int i = 0; i < kLogitsPerLane; ++i) {
    ex[i] = lane + 32 * i < num_experts ? exp(static_cast<double>(logit[i]) - max_logit) : 0.0;
    if (lane + 32 * i < num_experts) denom += ex[i];
  }
  denom = cuda::warp_sum(denom);
  float prob[kLogitsPerLane];  // -1: not an expert, or already chosen
#pragma unroll
  for (int i = 0; i < kLogitsPerLane; ++i) {
    prob[i] = lane + 32 * i < num_experts ? static_cast<float>(ex[i] / denom) : -1.0f;
  }
  // A probability (>= 0) orders as its bits, so each round is two warp reductions (redux.sync): the largest key
  // (bits + 1; 0 for a lane without a candidate), then the lowest expert holding it; the same choice as a
  // butterfly of (probability, expert) pairs in two instructions instead of ten shuffles.
  my_prob = 0.0f;
  sum = 0.0f;
  my_expert = -1;
#pragma unroll
  for (int j = 0; j < kMaxK; ++j) {
    if (j >= top_k) break;
    float lane_best = -2.0f;
    int lane_e = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kLogitsPerLane; ++i) {
      if (prob[i] > lane_best) {
        lane_best = prob[i];
        lane_e = lane + 32 * i;
      }
    }
    const unsigned key = lane_best >= 0.0f ? __float_as_uint(lane_best) + 1u : 0u;
    const unsigned best_key = __reduce_max_sync(0xffffffffu, key);
    const int best_e = static_cast<int>(
        __reduce_min_sync(0xffffffffu, key == best_key ? static_cast<unsigned>(lane_e) : 0x7fffffffu));
    const float best = __uint_as_float(best_key - 1u);
#pragma unroll
    for (int i = 0; i < kLogitsPerLane; ++i) {
      if (lane + 32 * i == best_e) prob[i] = -1.0f;
    }
    sum += best;  // every lane sums the same values in j order
    if (lane == j) {
      my_prob = best;
      my_expert = best_e;
    }
  }
}

}  // namespace fulcrum::gpu
