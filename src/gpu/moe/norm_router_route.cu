// The post-attention add + RMSNorm, router logits and small route in one launch (norm_router_route.hpp).
#include <algorithm>
#include <type_traits>

#include "backend/cuda/launch_util.cuh"
#include "gpu/env_switch.hpp"
#include "gpu/kernels/bulk_copy.cuh"
#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/norm_row.cuh"
#include "gpu/kernels/skinny_gemm_core.cuh"
#include "gpu/kernels/skinny_plan.hpp"
#include "gpu/moe/norm_router_route.hpp"
#include "gpu/moe/route_block.cuh"

namespace fulcrum::cuda::moe {
namespace {

namespace skinny = gpu::skinny;
namespace norm_row = gpu::norm_row;
constexpr int kThreads = skinny::kThreads;  // 4 warps: the skinny tiles' and the tiny plan's block
static_assert(kThreads == route_block::kTinyPlanThreads, "one block size for the tile and the plan");
constexpr int kMaxNormWarps = 32;  // add_rms_norm_vector_kernel's block at hidden 8192: 1024 threads

// Dynamic shared memory, in 16-byte words: the router tile [tile_rows][H / 8], the normed rows [M][H / 8], the plan's
// int32s with the histogram (route_block::small_route_smem_bytes), then the logits [M][E] fp32 (the last block's).
// The plan's words for n entries:
__host__ __device__ inline int64_t plan_words(int num_slots, int num_entries, int num_experts, bool record) {
  return static_cast<int64_t>((route_block::small_route_smem_bytes(num_slots, num_entries, num_experts, record) + 15) / 16);
}

// V: the vectors of 8 values a thread holds per row (ceil(H / 8 / 128)).
template <int R, int M, int V>
__global__ void __launch_bounds__(kThreads) norm_router_route_kernel(NormRouterRouteArgs a, int k_split,
                                                                     int tile_rows, int64_t plan_at,
                                                                     int64_t logits_at) {
  extern __shared__ __align__(128) uint4 smem[];
  __shared__ __align__(8) uint64_t full;
  __shared__ float partial[skinny::kWarpsPerBlock][skinny::kRowsPerWarp * skinny::kMaxRows];
  __shared__ int32_t s_slot_of[route_block::kSmallRouteSlotEntries];
  __shared__ double s_warp_sums[M][kMaxNormWarps];
  __shared__ bool s_last;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int hidden = a.hidden, num_experts = a.route.num_experts;
  const int64_t chunks = hidden / 8;
  const int64_t tile = blockIdx.x;  // the grid is one block per tile
  const int rows_here = static_cast<int>(min(static_cast<int64_t>(tile_rows), num_experts - tile * tile_rows));
  uint4* const w_tile = smem;
  uint4* const x_rows_s = smem + int64_t{tile_rows} * chunks;
  int32_t* const plan_smem = reinterpret_cast<int32_t*>(smem + plan_at);
  float* const s_logits = reinterpret_cast<float*>(smem + logits_at);
  const int num_entries = M * a.route.top_k;
  unsigned int* const s_hist =
      reinterpret_cast<unsigned int*>(plan_smem + route_block::small_route_hist_offset(a.num_slots, num_entries));

  // Before the wait, what no kernel of the step writes: the router tile (one bulk copy), the histogram cleared, the
  // sources' static dispatch rows.
  if (tid == 0) {
    gpu::bulk::barrier_init(&full);
    gpu::bulk::copy_to_shared(w_tile, reinterpret_cast<const uint4*>(a.router) + tile * tile_rows * chunks,
                              static_cast<uint32_t>(rows_here * chunks * 16), &full);
  }
  uint4 norm_w[V];  // the norm weight (no kernel writes it)
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int v = tid + kThreads * j;
    norm_w[j] = v < hidden / 8 ? __ldg(reinterpret_cast<const uint4*>(a.norm_weight) + v) : make_uint4(0, 0, 0, 0);
  }
  RouterArgs route = a.route;
  route_block::stage_before_wait<kThreads>(route, s_hist, s_slot_of);
  __syncthreads();  // the barrier is initialized before anyone waits on it
  gpu::wait_then_release();  // dependent_launch.cuh: delta comes from the kernel before

  // add + RMSNorm of every row, add_rms_norm_vector_kernel's arithmetic: its thread v (of H / 8 rounded up to a
  // warp) is thread v % 128 here in round v / 128, so its warp v / 32 is this warp in that round, and the warp
  // totals meet in the same butterfly. Every row's values are loaded at once and kept in registers (V vectors a
  // thread and row): one L2 round trip, where a loop over rows and a second pass made a chain of them (measured
  // 0.3 ms a step slower than the three launches at batch 1).
  const int vectors = hidden / 8, norm_warps = (vectors + 31) / 32;
  float4 lo[M][V], hi[M][V];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    const float4* res = reinterpret_cast<const float4*>(a.residual + int64_t{i} * hidden);
    const float4* del = reinterpret_cast<const float4*>(a.delta + int64_t{i} * hidden);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int v = tid + kThreads * j;
      lo[i][j] = hi[i][j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (v < vectors) {
        lo[i][j] = norm_row::add4(res[2 * v], del[2 * v]);
        hi[i][j] = norm_row::add4(res[2 * v + 1], del[2 * v + 1]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < M; ++i) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (warp + skinny::kWarpsPerBlock * j >= norm_warps) break;  // warp-uniform
      const float x[8] = {lo[i][j].x, lo[i][j].y, lo[i][j].z, lo[i][j].w, hi[i][j].x, hi[i][j].y, hi[i][j].z, hi[i][j].w};
      double sum_sq = 0;  // zeros past the row add nothing, as the vector kernel's idle threads
#pragma unroll
      for (int k = 0; k < 8; ++k) sum_sq += static_cast<double>(x[k]) * x[k];
      sum_sq = cuda::warp_sum(sum_sq);
      if (lane == 0) s_warp_sums[i][warp + skinny::kWarpsPerBlock * j] = sum_sq;
    }
  }
  __syncthreads();
  float inv_rms[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    const double total = cuda::warp_sum(lane < norm_warps ? s_warp_sums[i][lane] : 0.0);
    inv_rms[i] = norm_row::inv_rms_of(total, hidden, a.eps);
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int v = tid + kThreads * j;
    if (v >= vectors) break;
    float w[8];
    norm_row::unpack8(norm_w[j], w);
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const float4 l = lo[i][j], h = hi[i][j];
      uint4 packed;
      packed.x = norm_row::pack2(norm_row::norm_scale(w[0], l.x, inv_rms[i]), norm_row::norm_scale(w[1], l.y, inv_rms[i]));
      packed.y = norm_row::pack2(norm_row::norm_scale(w[2], l.z, inv_rms[i]), norm_row::norm_scale(w[3], l.w, inv_rms[i]));
      packed.z = norm_row::pack2(norm_row::norm_scale(w[4], h.x, inv_rms[i]), norm_row::norm_scale(w[5], h.y, inv_rms[i]));
      packed.w = norm_row::pack2(norm_row::norm_scale(w[6], h.z, inv_rms[i]), norm_row::norm_scale(w[7], h.w, inv_rms[i]));
      x_rows_s[i * chunks + v] = packed;
      // The blocks share the global copy (the expert GEMMs' input) between them.
      if (v % gridDim.x == blockIdx.x) reinterpret_cast<uint4*>(a.x_out + int64_t{i} * hidden)[v] = packed;
    }
  }
  __syncthreads();

  // This block's tile of router logits, as the skinny GEMM's bulk kernel computes it.
  gpu::bulk::wait_phase(&full, 0);
  const int group = warp / k_split, slice = warp % k_split;
  const int64_t begin = chunks * slice / k_split, end = chunks * (slice + 1) / k_split;
  const uint4* w_rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) w_rows[r] = w_tile + min(group * R + r, rows_here - 1) * chunks;
  const uint4* x_rows[M];
#pragma unroll
  for (int i = 0; i < M; ++i) x_rows[i] = x_rows_s + i * chunks;
  float acc[R][M];
  skinny::warp_dot_shared<R, M, true>(w_rows, x_rows, begin, end, lane, acc);
  skinny::sum_slices<R, M>(acc, warp, lane, k_split, partial);
  skinny::store_tile<R, M, false>(const_cast<float*>(route.logits), num_experts, k_split, tile, partial);  // ends with a barrier

  // The last block to store its logits routes and plans (threadFenceReduction's pattern: each block's stores,
  // a fence by every thread that stored, then the count; the last one fences again and reads the logits from L2).
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    s_last = atomicAdd(a.done_count, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  for (int q = tid; q < M * num_experts; q += kThreads) s_logits[q] = __ldcg(route.logits + q);
  if (tid == 0) *a.done_count = 0;  // at rest for the next launch (which starts after this grid completed)
  __syncthreads();
  route.logits = s_logits;
  route_block::route_and_plan<kThreads>(route, a.num_slots, a.slot_counts, a.offsets, a.entry_row, a.row_token,
                                        a.active, plan_smem, s_hist);
}

bool fused_norm_route_enabled() {
  static const bool enabled = gpu::env_switch_on("FULCRUM_FUSED_NORM_ROUTE");
  return enabled;
}

// A thread keeps V vectors of 8 values of each of M rows: M x V <= kMaxRowVectors (registers), V <= 4.
constexpr int kMaxRowVectors = 8;
int norm_vectors_per_thread(int hidden) {
  const int v = (hidden / 8 + kThreads - 1) / kThreads;
  return v <= 1 ? 1 : v <= 2 ? 2 : v <= 4 ? 4 : 8;
}

bool aligned16(const void* p) { return p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The skinny GEMM's split of the router (launch_skinny_gemm's for m rows): K slices from E / 4 and H, tiles of
// kWarpsPerBlock / k_split groups of R rows.
struct RouterTiles {
  int k_split, tile_rows;
  int64_t tiles;
};
RouterTiles router_tiles(int num_experts, int hidden, int r) {
  RouterTiles t{};
  t.k_split = skinny::choose_k_split((int64_t{num_experts} + skinny::kRowsPerWarp - 1) / skinny::kRowsPerWarp, hidden / 8);
  t.tile_rows = skinny::kWarpsPerBlock / t.k_split * r;
  t.tiles = (int64_t{num_experts} + t.tile_rows - 1) / t.tile_rows;
  return t;
}

// The dynamic shared memory of M tokens: tile, normed rows, plan + histogram, logits.
struct SmemPlan {
  int64_t plan_at, logits_at, bytes;
};
SmemPlan smem_plan(const RouterTiles& t, int hidden, int m, int top_k, int num_slots, int num_experts, bool record) {
  SmemPlan s{};
  const int64_t chunks = hidden / 8;
  s.plan_at = (int64_t{t.tile_rows} + m) * chunks;
  s.logits_at = s.plan_at + plan_words(num_slots, m * top_k, num_experts, record);
  s.bytes = 16 * (s.logits_at + (int64_t{m} * num_experts + 3) / 4);
  return s;
}

}  // namespace

bool norm_router_route_supported(int64_t num_tokens, int top_k, int hidden, int num_experts, int num_slots) {
  if (num_tokens < 1 || num_tokens > kNormRouterRouteMaxTokens || top_k < 1 || top_k > kMaxTopK ||
      num_tokens * top_k > route_block::kTinyPlanThreads / 4 || hidden <= 0 || hidden % 8 != 0 ||
      hidden > 8 * 32 * kMaxNormWarps || num_experts < 1 || num_experts > kMaxRouterExperts || num_slots < 1 ||
      num_slots > kSmallPlanMaxSlots) {
    return false;
  }
  if (!fused_norm_route_enabled() || !tiny_plan_enabled()) return false;
  const int m = static_cast<int>(num_tokens);
  const int v = norm_vectors_per_thread(hidden);
  if (v > 4 || m * v > kMaxRowVectors) return false;
  const RouterTiles t = router_tiles(num_experts, hidden, skinny::rows_per_warp(m));
  if (!skinny::bulk_tile_allowed(int64_t{t.tile_rows} * hidden * 2)) return false;
  int device = 0, max_optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  // Static shared memory (the slot rows, partial sums, norm sums) within ~8 KB of the opt-in limit.
  return smem_plan(t, hidden, m, top_k, num_slots, num_experts, true).bytes + 8 * 1024 <= max_optin;
}

cudaError_t launch_norm_router_route(const NormRouterRouteArgs& args, cudaStream_t stream) {
  const RouterArgs& r = args.route;
  if (!norm_router_route_supported(r.num_tokens, r.top_k, args.hidden, r.num_experts, args.num_slots)) {
    return cudaErrorInvalidValue;
  }
  if (!aligned16(args.residual) || !aligned16(args.delta) || !aligned16(args.norm_weight) || !aligned16(args.x_out) ||
      !aligned16(args.router) || r.static_slot_of == nullptr || r.logits == nullptr || args.done_count == nullptr ||
      args.slot_counts == nullptr || args.offsets == nullptr || args.entry_row == nullptr ||
      args.row_token == nullptr || args.active == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int m = static_cast<int>(r.num_tokens);
  const auto launch = [&](auto rows_per_warp, auto rows) -> cudaError_t {
    constexpr int R = decltype(rows_per_warp)::value, M = decltype(rows)::value;
    const RouterTiles t = router_tiles(r.num_experts, args.hidden, R);
    const SmemPlan s = smem_plan(t, args.hidden, M, r.top_k, args.num_slots, r.num_experts, r.histogram != nullptr);
    const auto go = [&](auto kernel) -> cudaError_t {
      const cudaError_t status =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(s.bytes));
      if (status != cudaSuccess) return status;
      return gpu::launch_dependent(kernel, dim3(static_cast<unsigned>(t.tiles)), dim3(kThreads),
                                   static_cast<size_t>(s.bytes), stream, args, t.k_split, t.tile_rows, s.plan_at,
                                   s.logits_at);
    };
    switch (norm_vectors_per_thread(args.hidden)) {
      case 1: return go(norm_router_route_kernel<R, M, 1>);
      case 2:
        if constexpr (M * 2 <= kMaxRowVectors) return go(norm_router_route_kernel<R, M, 2>);
        break;
      case 4:
        if constexpr (M * 4 <= kMaxRowVectors) return go(norm_router_route_kernel<R, M, 4>);
        break;
      default: break;
    }
    return cudaErrorInvalidValue;  // norm_router_route_supported refused it first
  };
  using skinny::kRowsPerWarp;
  using skinny::kWideRowsPerWarp;
  switch (m) {
    case 1:
      return skinny::rows_per_warp(1) == kWideRowsPerWarp
                 ? launch(std::integral_constant<int, kWideRowsPerWarp>{}, std::integral_constant<int, 1>{})
                 : launch(std::integral_constant<int, kRowsPerWarp>{}, std::integral_constant<int, 1>{});
    case 2: return launch(std::integral_constant<int, kRowsPerWarp>{}, std::integral_constant<int, 2>{});
    case 3: return launch(std::integral_constant<int, kRowsPerWarp>{}, std::integral_constant<int, 3>{});
    default: return launch(std::integral_constant<int, kRowsPerWarp>{}, std::integral_constant<int, 4>{});
  }
}

}  // namespace fulcrum::cuda::moe
