#pragma once
// Router logits, routing and the permutation plan of a decode step of 1..kRouterClusterMaxTokens tokens with
// static replicas, in one launch: one thread block cluster of kRouterClusterBlocks blocks. Each block multiplies
// its tiles of the router matrix with bulk-copied weights, in the dense skinny GEMM's tiles, K slices and
// arithmetic (skinny_gemm_core.cuh), so the logits are those of launch_skinny_gemm bit for bit; it stores them to
// `logits` and into the first block's shared memory; after a cluster barrier the first block routes and plans as
// launch_small_route_permute does (route_block.cuh), the same outputs bit for bit. It replaces two launches (the
// router's skinny GEMM, then the single-block route) and the kernel boundary between them, where the route block
// waited for the whole router grid to drain and read its logits back from L2, on every MoE layer's critical path.
#include <cstdint>

#include <cuda_runtime.h>

#include "gpu/moe/moe_kernels.hpp"

namespace fulcrum::cuda::moe {

constexpr int kRouterClusterBlocks = 8;  // the portable cluster size; the 30B router's 8 tiles at one token
constexpr int kRouterClusterMaxTokens = 4;

// Whether launch_router_route_cluster takes this step: 1 <= T <= kRouterClusterMaxTokens, E <= kMaxRouterExperts,
// T x k <= kSmallPlanMaxEntries, P <= kSmallPlanMaxSlots, hidden % 8 == 0, and the block's shared memory (its share
// of the router's tiles, T x E logits, the plan) within what the device allows.
bool router_route_cluster_fits(int64_t num_tokens, int num_experts, int top_k, int hidden_size, int num_slots);
// Whether the MoE layer uses it: FULCRUM_ROUTER_CLUSTER=1 (off by default: measured slower than the two launches,
// docs/benchmarks.md); read once.
bool router_route_cluster_enabled();

// x bf16 [T, hidden], router_w bf16 [E, hidden] (both 16-byte aligned) -> logits fp32 [T, E]; then args' routing
// (args.logits is ignored: the first block reads its own copy; args.static_slot_of must be set) and the plan's
// slot_counts [P], offsets [P + 1], entry_row [T k], row_token [T k], active [1 + P]. cudaErrorInvalidValue where
// router_route_cluster_fits is false or a pointer is null / misaligned. Capture-safe (one cluster, fixed grid).
cudaError_t launch_router_route_cluster(const uint16_t* x, const uint16_t* router_w, int hidden_size, float* logits,
                                        const RouterArgs& args, int num_slots, int32_t* slot_counts, int32_t* offsets,
                                        int32_t* entry_row, int32_t* row_token, int32_t* active, cudaStream_t stream);

}  // namespace fulcrum::cuda::moe
