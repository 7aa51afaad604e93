#pragma once
// The front of the MoE layer in a decode step of 1..4 tokens, in one launch where three ran: the post-attention
// add + RMSNorm (gpu::launch_add_rms_norm), the router logits (gpu::launch_skinny_gemm) and the routing with the
// permutation plan (launch_small_route_permute, static replicas). Each of its blocks computes the norm of every
// row (the rows are a few KB), multiplies it with one tile of router rows bulk-copied into shared memory before the
// PDL wait, and stores that tile's logits; the last block to finish (a counter) routes and plans. Each kernel
// boundary on a graph step's critical path costs ~2 us (FULCRUM_ABLATE in docs/benchmarks.md), this removes two a
// MoE layer.
//
// Same bits as the three launches: the norm repeats add_rms_norm_vector_kernel's arithmetic and reduction tree
// (gpu/kernels/norm_row.cuh; its block of H / 8 threads emulated over 128), the logits use the skinny GEMM's K split
// and sums (skinny_gemm_core.cuh), the route and plan are route_block.cuh's (tests_cuda/moe_norm_route_test.cpp
// compares all of it). One difference: the sum residual + delta is not written back; the next add + RMSNorm adds
// delta before the MoE combine (gpu::MoeCombineDelta::residual_delta), which gives the residual the same bits.
//
// Capture-safe: the counter (one uint32, zero at rest) is reset by the last block; no host synchronization.
#include <cstdint>

#include <cuda_runtime.h>

#include "gpu/moe/moe_kernels.hpp"

namespace fulcrum::cuda::moe {

struct NormRouterRouteArgs {
  // x_out[t] = bf16(norm_weight * (s * inv_rms(s))), s = residual[t] + delta[t] in fp32, for t < route.num_tokens.
  const float* residual = nullptr;        // [T, H] fp32
  const float* delta = nullptr;           // [T, H] fp32
  const uint16_t* norm_weight = nullptr;  // [H] bf16
  float eps = 0.0f;
  int hidden = 0;
  uint16_t* x_out = nullptr;         // [T, H] bf16
  const uint16_t* router = nullptr;  // [E, H] bf16
  // logits (written, [T, E] fp32), tokens, experts, top-k, static slots (required), outputs, histogram.
  RouterArgs route;
  int num_slots = 0;
  int32_t* slot_counts = nullptr;  // the permutation plan, as launch_small_route_permute's
  int32_t* offsets = nullptr;
  int32_t* entry_row = nullptr;
  int32_t* row_token = nullptr;
  int32_t* active = nullptr;
  unsigned int* done_count = nullptr;  // zero before the launch; zero again after it
};

constexpr int kNormRouterRouteMaxTokens = 4;

// Whether a step of this shape can take it (else the three launches): 1..4 tokens with T x k <= 32 (the 128-thread
// plan), hidden % 8 == 0 with T x ceil(H / 1024) <= 8 (every row's values in registers: H 2048 up to 4 tokens,
// 4096 up to 2), E <= kMaxRouterExperts, P <= kSmallPlanMaxSlots, a router tile within the bulk
// copy bound (gpu::skinny::bulk_tile_allowed), and the switches: FULCRUM_FUSED_NORM_ROUTE=0 (for measurement),
// FULCRUM_TINY_PLAN=0 or FULCRUM_SKINNY_BULK=0 turn it off; read once.
bool norm_router_route_supported(int64_t num_tokens, int top_k, int hidden, int num_experts, int num_slots);

// cudaErrorInvalidValue when the shape is not supported, a pointer is null or not 16-byte aligned (residual,
// delta, norm_weight, x_out, router), or static_slot_of is null.
cudaError_t launch_norm_router_route(const NormRouterRouteArgs& args, cudaStream_t stream);

}  // namespace fulcrum::cuda::moe
