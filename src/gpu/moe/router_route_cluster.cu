// Router logits + route + plan in one cluster launch (router_route_cluster.hpp).
//
// Dynamic shared memory of every block: [tile_slots tiles of W][T x E logits, rounded to 16 bytes][the route's plan
// memory (route_block.cuh small_route_smem_bytes)]; only the first block uses the last two. Block b of the cluster
// takes tiles b, b + C, ... (the dense skinny GEMM's tiles: kWarpsPerBlock / k_split row groups of R router rows),
// each by one bulk copy before the PDL wait (W is no kernel's output), all in flight at once.
#include <algorithm>

#include <cooperative_groups.h>

#include "gpu/env_switch.hpp"
#include "gpu/kernels/bulk_copy.cuh"
#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/skinny_gemm_core.cuh"
#include "gpu/moe/route_block.cuh"
#include "gpu/moe/router_route_cluster.hpp"

namespace fulcrum::cuda::moe {
namespace {

namespace cg = cooperative_groups;
using namespace gpu::skinny;
using namespace route_block;

constexpr int kMaxTileSlots = 4;  // tiles a block takes at most (each on its own barrier)

struct ClusterShape {
  int r = 0, k_split = 0, tile_rows = 0;
  int64_t tiles = 0, tile_slots = 0, tile_bytes = 0, logits_bytes = 0, plan_bytes = 0;
  size_t smem() const { return static_cast<size_t>(tile_slots * tile_bytes + logits_bytes + plan_bytes); }
};

// The dense skinny GEMM's split for [T, hidden] x [E, hidden]^T (skinny_gemm.cu launch_rows): the same K slices,
// hence the same bits.
ClusterShape cluster_shape(int64_t num_tokens, int num_experts, int top_k, int hidden_size, int num_slots) {
  ClusterShape s;
  const int m = static_cast<int>(num_tokens);
  s.r = rows_per_warp(m);
  s.k_split = choose_k_split((static_cast<int64_t>(num_experts) + kRowsPerWarp - 1) / kRowsPerWarp, hidden_size / 8);
  const int groups_per_block = kWarpsPerBlock / s.k_split;
  s.tile_rows = groups_per_block * s.r;
  s.tiles = ((num_experts + s.r - 1) / s.r + groups_per_block - 1) / groups_per_block;
  s.tile_slots = (s.tiles + kRouterClusterBlocks - 1) / kRouterClusterBlocks;
  s.tile_bytes = int64_t{s.tile_rows} * hidden_size * 2;
  s.logits_bytes = (num_tokens * num_experts * 4 + 15) / 16 * 16;
  s.plan_bytes = static_cast<int64_t>(small_route_smem_bytes(num_slots, static_cast<int>(num_tokens * top_k),
                                                             num_experts, true));
  return s;
}

// Block rank b of the one cluster: its tiles' logits (to `logits` and to block 0's copy), then block 0 routes and
// plans. 128 threads (kThreads = route_block's kTinyPlanThreads).
template <int R, int M>
__global__ void __launch_bounds__(kThreads) router_route_cluster_kernel(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ w, int n, int k, int k_split, int tiles,
    int tile_slots, int64_t logits_bytes, bool late_release, float* __restrict__ logits, RouterArgs a, int num_slots,
    int32_t* slot_counts, int32_t* offsets, int32_t* entry_row, int32_t* row_token, int32_t* active) {
  static_assert(kThreads == kTinyPlanThreads, "block 0 plans as the 128-thread route block");
  extern __shared__ __align__(128) uint4 smem[];
  __shared__ __align__(8) uint64_t full[kMaxTileSlots];
  __shared__ float partial[kWarpsPerBlock][kRowsPerWarp * kMaxRows];
  __shared__ int32_t s_slot_of[kSmallRouteSlotEntries];
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank()), blocks = static_cast<int>(cluster.num_blocks());
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int groups_per_block = kWarpsPerBlock / k_split, tile_rows = groups_per_block * R;
  const int64_t chunks = k / 8;  // per row
  const int64_t per_tile = tile_rows * chunks;
  const int my_tiles = rank < tiles ? (tiles - rank + blocks - 1) / blocks : 0;
  float* s_logits = reinterpret_cast<float*>(smem + tile_slots * per_tile);  // [M, n], block 0's is read
  int32_t* plan_smem = reinterpret_cast<int32_t*>(reinterpret_cast<char*>(s_logits) + logits_bytes);
  const int num_entries = M * a.top_k;
  unsigned int* s_hist = reinterpret_cast<unsigned int*>(plan_smem + small_route_hist_offset(num_slots, num_entries));
  const auto rows_of = [&](int64_t tile) { return static_cast<int>(min(static_cast<int64_t>(tile_rows), n - tile * tile_rows)); };
  if (threadIdx.x == 0) {
    for (int j = 0; j < my_tiles; ++j) {
      const int64_t tile = rank + int64_t{j} * blocks;
      gpu::bulk::barrier_init(&full[j]);
      gpu::bulk::copy_to_shared(smem + j * per_tile, reinterpret_cast<const uint4*>(w) + tile * per_tile,
                                static_cast<uint32_t>(rows_of(tile) * chunks * 16), &full[j]);
    }
  }
  if (rank == 0) stage_before_wait<kThreads>(a, s_hist, s_slot_of);  // what no kernel of the step writes
  __syncthreads();  // the barriers are initialized before anyone waits on them
  // Every block of the cluster has started before any writes into block 0's shared memory; before the PDL wait,
  // so the barrier overlaps the kernel before.
  cluster.sync();
  gpu::wait_for_previous();  // dependent_launch.cuh: x comes from the previous kernel
  if (!late_release) gpu::release_dependents();
  float* remote_logits = cluster.map_shared_rank(s_logits, 0);
  const int group = warp / k_split, slice = warp % k_split;
  const int64_t begin = chunks * slice / k_split, end = chunks * (slice + 1) / k_split;
  const uint4* x_rows[M];
#pragma unroll
  for (int i = 0; i < M; ++i) x_rows[i] = reinterpret_cast<const uint4*>(x) + i * chunks;
  for (int j = 0; j < my_tiles; ++j) {
    const int64_t tile = rank + int64_t{j} * blocks;
    gpu::bulk::wait_phase(&full[j], 0);
    const int last = rows_of(tile) - 1;  // rows past n read the tile's last row and store nothing
    const uint4* w_rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r) w_rows[r] = smem + j * per_tile + min(group * R + r, last) * chunks;
    float acc[R][M];
    warp_dot_shared<R, M>(w_rows, x_rows, begin, end, lane, acc);
    sum_slices<R, M>(acc, warp, lane, k_split, partial);
    const int t = static_cast<int>(threadIdx.x);
    if (t < groups_per_block * R * M) {  // store_tile's mapping, to both copies
      const int g = t / (R * M), jr = t % (R * M), r = jr / M, i = jr % M;
      const int64_t row = (tile * groups_per_block + g) * R + r;
      if (row < n) {
        const float v = partial[g * k_split][jr];
        logits[i * static_cast<int64_t>(n) + row] = v;
        remote_logits[i * n + row] = v;
      }
    }
    __syncthreads();  // partial is rewritten by the next tile
  }
  cluster.sync();  // release / acquire: every block's logits are in block 0's shared memory
  if (rank != 0) return;
  a.logits = s_logits;
  route_and_plan<kThreads>(a, num_slots, slot_counts, offsets, entry_row, row_token, active, plan_smem, s_hist);
  if (late_release) gpu::release_dependents();
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// FULCRUM_ROUTER_CLUSTER_LATE_RELEASE=1: the next kernel is scheduled only once block 0 has planned (blocks 1.. let it
// at their exit), not as soon as every block has waited; for measurement; read once.
bool late_release() {
  static const bool late = gpu::env_int("FULCRUM_ROUTER_CLUSTER_LATE_RELEASE", 0) != 0;
  return late;
}

// The device's opt-in shared memory per block (queried once per process; the engine drives one device).
int max_shared_per_block() {
  static const int bytes = [] {
    int device = 0, value = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
      return 0;
    }
    return value;
  }();
  return bytes;
}

template <int R, int M>
cudaError_t launch_shape(const ClusterShape& s, const uint16_t* x, const uint16_t* w, int hidden_size, float* logits,
                         const RouterArgs& args, int num_slots, int32_t* slot_counts, int32_t* offsets,
                         int32_t* entry_row, int32_t* row_token, int32_t* active, cudaStream_t stream) {
  const auto kernel = router_route_cluster_kernel<R, M>;
  const size_t smem = s.smem();
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (status != cudaSuccess) return status;
  // One cluster along z (launch_dependent_clustered's grouping); the kernel reads its rank from the cluster.
  return gpu::launch_dependent_clustered(kernel, dim3(1, 1, kRouterClusterBlocks), dim3(kThreads), smem, stream,
                                         kRouterClusterBlocks, x, w, args.num_experts, hidden_size, s.k_split,
                                         static_cast<int>(s.tiles), static_cast<int>(s.tile_slots), s.logits_bytes,
                                         late_release(), logits, args, num_slots, slot_counts, offsets, entry_row, row_token, active);
}

}  // namespace

bool router_route_cluster_enabled() {
  static const bool enabled = gpu::env_int("FULCRUM_ROUTER_CLUSTER", 0) != 0;
  return enabled;
}

bool router_route_cluster_fits(int64_t num_tokens, int num_experts, int top_k, int hidden_size, int num_slots) {
  if (num_tokens < 1 || num_tokens > kRouterClusterMaxTokens || num_experts < 1 ||
      num_experts > kMaxRouterExperts || top_k < 1 || top_k > kMaxTopK || num_tokens * top_k > kSmallPlanMaxEntries ||
      num_slots < 1 || num_slots > kSmallPlanMaxSlots || hidden_size < 8 || hidden_size % 8 != 0) {
    return false;
  }
  const ClusterShape s = cluster_shape(num_tokens, num_experts, top_k, hidden_size, num_slots);
  const size_t static_bytes = sizeof(uint64_t) * kMaxTileSlots + sizeof(float) * kWarpsPerBlock * kRowsPerWarp *
                              kMaxRows + sizeof(int32_t) * kSmallRouteSlotEntries + 1024;  // + cub's scan storage
  return s.tile_slots <= kMaxTileSlots && s.smem() + static_bytes <= static_cast<size_t>(max_shared_per_block());
}

cudaError_t launch_router_route_cluster(const uint16_t* x, const uint16_t* router_w, int hidden_size, float* logits,
                                        const RouterArgs& args, int num_slots, int32_t* slot_counts, int32_t* offsets,
                                        int32_t* entry_row, int32_t* row_token, int32_t* active, cudaStream_t stream) {
  if (!router_route_cluster_fits(args.num_tokens, args.num_experts, args.top_k, hidden_size, num_slots) ||
      x == nullptr || router_w == nullptr || !aligned16(x) || !aligned16(router_w) || logits == nullptr ||
      args.static_slot_of == nullptr || args.expert_ids == nullptr || args.weights == nullptr ||
      args.slots == nullptr || slot_counts == nullptr || offsets == nullptr || entry_row == nullptr ||
      row_token == nullptr || active == nullptr) {
    return cudaErrorInvalidValue;
  }
  const ClusterShape s = cluster_shape(args.num_tokens, args.num_experts, args.top_k, hidden_size, num_slots);
  const auto go = [&](auto r, auto m) {
    return launch_shape<decltype(r)::value, decltype(m)::value>(s, x, router_w, hidden_size, logits, args, num_slots,
                                                                 slot_counts, offsets, entry_row, row_token, active,
                                                                 stream);
  };
  using One = std::integral_constant<int, 1>;
  switch (args.num_tokens) {
    case 1:
      return s.r == kWideRowsPerWarp ? go(std::integral_constant<int, kWideRowsPerWarp>{}, One{})
                                     : go(std::integral_constant<int, kRowsPerWarp>{}, One{});
    case 2: return go(std::integral_constant<int, kRowsPerWarp>{}, std::integral_constant<int, 2>{});
    case 3: return go(std::integral_constant<int, kRowsPerWarp>{}, std::integral_constant<int, 3>{});
    default: return go(std::integral_constant<int, kRowsPerWarp>{}, std::integral_constant<int, 4>{});
  }
}

}  // namespace fulcrum::cuda::moe
