// Skinny GEMM (skinny_gemm.hpp). Work split (the K slices from n and k only, never m, so results are batch
// invariant):
//   - a warp owns a group of R consecutive W rows (8 for m = 1, else 4: skinny::rows_per_warp) and one K slice;
//   - k_split (1, 2 or 4, chosen for groups of 4 rows) warps of a block share a row group, each with a contiguous
//     K slice; a block of 4 warps holds 4 / k_split row groups (skinny::choose_k_split);
//   - the dot products and the slice sums are skinny_gemm_core.cuh's, shared with the expert skinny GEMMs.
// FP8 weights (launch_skinny_gemm_fp8): the same split in FP8 chunks of 16 weights (K slices from k / 16), each
// row group's scale column that of its first row (R divides 128 and groups start at multiples of R, so a group's
// rows share a 128-row block; rows past n only read).
#include <algorithm>
#include <type_traits>

#include "gpu/kernels/bulk_copy.cuh"
#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/skinny_gemm.hpp"
#include "gpu/kernels/skinny_gemm_core.cuh"

namespace fulcrum::gpu {
namespace {

using namespace skinny;

template <bool kBf16Out>
__device__ __forceinline__ void store_out(void* out, int64_t idx, float v) {
  if constexpr (kBf16Out) {
    static_cast<uint16_t*>(out)[idx] = to_bf16(v);
  } else {
    static_cast<float*>(out)[idx] = v;
  }
}

// The warp's W rows and K slice [begin, end) (in chunks) in tile `tile` (4 / k_split groups of R rows). Rows
// past n (the last group) read row n - 1 and store nothing.
template <int R>
struct TileSlice {
  const uint4* w_rows[R];
  int64_t begin, end;
};
template <int R>
__device__ __forceinline__ TileSlice<R> tile_slice(const uint16_t* w, int n, int k, int k_split, int64_t tile) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int groups_per_block = kWarpsPerBlock / k_split;
  const int64_t first_row = (tile * groups_per_block + warp / k_split) * R;
  const int slice = warp % k_split;
  const int64_t chunks = k / 8;  // per row
  TileSlice<R> ts;
  ts.begin = chunks * slice / k_split;
  ts.end = chunks * (slice + 1) / k_split;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = first_row + r < n ? first_row + r : n - 1;
    ts.w_rows[r] = reinterpret_cast<const uint4*>(w) + row * chunks;
  }
  return ts;
}

// The block's sums of tile `tile` (sum_slices' partial) stored to out [M, n]; then a barrier, since partial is
// rewritten by the block's next tile.
template <int R, int M, bool kBf16Out>
__device__ __forceinline__ void store_tile(void* __restrict__ out, int n, int k_split, int64_t tile,
                                           const float (*partial)[kRowsPerWarp * kMaxRows]) {
  const int groups_per_block = kWarpsPerBlock / k_split;
  const int t = static_cast<int>(threadIdx.x);
  if (t < groups_per_block * R * M) {
    const int group = t / (R * M), j = t % (R * M);
    const int r = j / M, i = j % M;
    const int64_t row = (tile * groups_per_block + group) * R + r;
    if (row < n) store_out<kBf16Out>(out, i * static_cast<int64_t>(n) + row, partial[group * k_split][j]);
  }
  __syncthreads();
}

// Tile `tile`. x [M, k], w [n, k], out [M, n]. With kFirst, `first` holds the warp's first W trip of this
// tile (load_first_trip); every warp still reaches __syncthreads.
template <int R, int M, bool kBf16Out, bool kFirst = false>
__device__ __forceinline__ void skinny_tile(const uint16_t* x, const uint16_t* __restrict__ w, int n,
                                            int k, int k_split, void* __restrict__ out, int64_t tile,
                                            float (*partial)[kRowsPerWarp * kMaxRows],
                                            const FirstTrip<R>* first = nullptr) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t chunks = k / 8;  // per row
  const TileSlice<R> ts = tile_slice<R>(w, n, k, k_split, tile);
  const uint4* x_rows[M];
#pragma unroll
  for (int i = 0; i < M; ++i) x_rows[i] = reinterpret_cast<const uint4*>(x) + i * chunks;

  float acc[R][M];
  warp_dot<R, M, kFirst>(ts.w_rows, x_rows, ts.begin, ts.end, lane, acc, first);
  sum_slices<R, M>(acc, warp, lane, k_split, partial);
  store_tile<R, M, kBf16Out>(out, n, k_split, tile, partial);
}

// Persistent grid: block b takes tiles b, b + gridDim.x, ... of `tiles` (a tile: 4 / k_split row groups). With
// one x row the first tile's first W trip is loaded before the wait (FirstTrip), so it overlaps the kernel before;
// with early_w false (FULCRUM_SKINNY_EARLY_W=0, for measurement) right after it. No bulk L2 prefetch of W: prefetches of the
// first and the next 1..4 tiles measured slower at batch 1 and 4 (bench/results/skinny_prefetch_sweep_h200.json).
template <int R, int M, bool kBf16Out>
__global__ void __launch_bounds__(kThreads) skinny_gemm_kernel(const uint16_t* x,
                                                               const uint16_t* __restrict__ w, int n, int k,
                                                               int k_split, int64_t tiles, bool early_w,
                                                               bool l2_next, void* __restrict__ out) {
  __shared__ float partial[kWarpsPerBlock][kRowsPerWarp * kMaxRows];
  const int64_t tile = blockIdx.x;  // < tiles: the grid has at most `tiles` blocks
  if constexpr (M == 1) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const TileSlice<R> ts = tile_slice<R>(w, n, k, k_split, tile);
    FirstTrip<R> first;
    if (early_w) load_first_trip<R>(ts.w_rows, ts.begin, ts.end, lane, first);
    wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
    if (!early_w) load_first_trip<R>(ts.w_rows, ts.begin, ts.end, lane, first);
    // Each later tile's first trip is asked of L2 as the tile before starts (no registers held).
    const auto ask_l2_after = [&](int64_t t) {
      if (l2_next && t + gridDim.x < tiles) {
        const TileSlice<R> after = tile_slice<R>(w, n, k, k_split, t + gridDim.x);
        prefetch_first_trip_l2<R>(after.w_rows, after.begin, after.end, lane);
      }
    };
    ask_l2_after(tile);
    skinny_tile<R, M, kBf16Out, true>(x, w, n, k, k_split, out, tile, partial, &first);
    for (int64_t next = tile + gridDim.x; next < tiles; next += gridDim.x) {
      ask_l2_after(next);
      skinny_tile<R, M, kBf16Out>(x, w, n, k, k_split, out, next, partial);
    }
  } else {
    // 2..8 x rows: the peeled first trip took 78 -> 96 .. 128 -> 168 registers (fewer resident blocks), so these
    // load everything after the wait.
    wait_then_release();
    for (int64_t t = tile; t < tiles; t += gridDim.x) skinny_tile<R, M, kBf16Out>(x, w, n, k, k_split, out, t, partial);
  }
}

// ---- W through bulk copies (FULCRUM_SKINNY_BULK, on unless "0") ----
// The same tiles, warps, K slices and arithmetic as skinny_gemm_kernel (so the same bits), but a tile's W rows,
// contiguous in memory, reach shared memory by one bulk copy (bulk_copy.cuh) into one of `stages` buffers
// (plan_bulk_grid): a block asks for its first `stages` tiles before the PDL wait (W is no kernel's output) and for
// tile j + stages as soon as its warps are done reading tile j, so all of a tile is in flight at once with no
// register held for it; the register path keeps at most two 16-byte loads per lane and row in flight, and only its
// first trip before the wait. Lanes read 16-byte chunks of a row side by side (conflict-free), x through L1.
template <int R, int M, bool kBf16Out>
__global__ void __launch_bounds__(kThreads) skinny_bulk_kernel(const uint16_t* x,
                                                               const uint16_t* __restrict__ w, int n, int k,
                                                               int k_split, int64_t tiles, int stages,
                                                               void* __restrict__ out) {
  extern __shared__ __align__(128) uint4 stage_chunks[];  // [stages][tile_rows][k / 8]
  __shared__ __align__(8) uint64_t full[kBulkStages];
  __shared__ float partial[kWarpsPerBlock][kRowsPerWarp * kMaxRows];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int tile_rows = kWarpsPerBlock / k_split * R;
  const int64_t chunks = k / 8;  // per row
  const int64_t per_stage = tile_rows * chunks;
  const int64_t grid = gridDim.x;
  const auto rows_of = [&](int64_t tile) { return static_cast<int>(min(static_cast<int64_t>(tile_rows), n - tile * tile_rows)); };
  const auto ask = [&](int stage, int64_t tile) {  // one thread
    bulk::copy_to_shared(stage_chunks + stage * per_stage, reinterpret_cast<const uint4*>(w) + tile * per_stage,
                         static_cast<uint32_t>(rows_of(tile) * chunks * 16), &full[stage]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) bulk::barrier_init(&full[s]);
    for (int s = 0; s < stages && blockIdx.x + s * grid < tiles; ++s) ask(s, blockIdx.x + s * grid);
  }
  __syncthreads();  // the barriers are initialized before anyone waits on them
  wait_then_release();  // dependent_launch.cuh: x comes from the previous kernel
  const int group = warp / k_split, slice = warp % k_split;
  const int64_t begin = chunks * slice / k_split, end = chunks * (slice + 1) / k_split;
  const uint4* x_rows[M];
#pragma unroll
  for (int i = 0; i < M; ++i) x_rows[i] = reinterpret_cast<const uint4*>(x) + i * chunks;
  int use = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += grid, ++use) {
    const int stage = use % stages;
    bulk::wait_phase(&full[stage], static_cast<uint32_t>(use / stages) & 1u);
    const int last = rows_of(tile) - 1;  // rows past n read the tile's last row and store nothing
    const uint4* w_rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r) w_rows[r] = stage_chunks + stage * per_stage + min(group * R + r, last) * chunks;
    float acc[R][M];
    warp_dot_shared<R, M>(w_rows, x_rows, begin, end, lane, acc);
    sum_slices<R, M>(acc, warp, lane, k_split, partial);  // its barrier: every warp is done with the stage
    if (threadIdx.x == 0 && tile + stages * grid < tiles) {
      bulk::fence_before_async_write();
      ask(stage, tile + stages * grid);
    }
    store_tile<R, M, kBf16Out>(out, n, k_split, tile, partial);
  }
}

// The bulk kernel for these tiles, or cudaErrorNotSupported when it does not apply (switched off, or a tile
// larger than kBulkMaxTileBytes: the LM head's 32-row tiles of 2048), for the register path.
template <int R, int M, bool kBf16Out>
cudaError_t launch_bulk(const uint16_t* x, const uint16_t* w, int n, int k, int k_split, int64_t tiles, void* out,
                        bool forced, cudaStream_t stream) {
  const int64_t tile_bytes = int64_t{kWarpsPerBlock / k_split * R} * k * 2;
  if (!bulk_tile_allowed(tile_bytes, forced)) return cudaErrorNotSupported;
  const auto kernel = skinny_bulk_kernel<R, M, kBf16Out>;
  int stages = 0;
  int64_t blocks = 0;
  if (!plan_bulk_grid(reinterpret_cast<const void*>(kernel), tiles, tile_bytes, stages, blocks)) {
    return cudaErrorNotSupported;
  }
  return launch_dependent(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                          static_cast<size_t>(stages * tile_bytes), stream, x, w, n, k, k_split, tiles, stages, out);
}

template <int R, int M>
cudaError_t launch_rows(const uint16_t* x, const uint16_t* w, int n, int k, void* out, bool bf16_out,
                        cudaStream_t stream, SkinnyWeightLoads loads) {
  const int k_split = choose_k_split((static_cast<int64_t>(n) + kRowsPerWarp - 1) / kRowsPerWarp, k / 8);
  const int64_t row_groups = (static_cast<int64_t>(n) + R - 1) / R;
  const int groups_per_block = kWarpsPerBlock / k_split;
  const int64_t tiles = (row_groups + groups_per_block - 1) / groups_per_block;
  if (loads != SkinnyWeightLoads::kRegisters) {
    const bool forced = loads == SkinnyWeightLoads::kBulk;
    const cudaError_t bulk = bf16_out ? launch_bulk<R, M, true>(x, w, n, k, k_split, tiles, out, forced, stream)
                                      : launch_bulk<R, M, false>(x, w, n, k, k_split, tiles, out, forced, stream);
    if (bulk != cudaErrorNotSupported) return bulk;
  }
  const int64_t blocks = skinny_grid_blocks(tiles, M);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  if (bf16_out) {
    return launch_dependent(skinny_gemm_kernel<R, M, true>, grid, dim3(kThreads), 0, stream, x, w, n, k, k_split, tiles,
                            skinny_early_w_enabled(), skinny_l2_next_enabled(), out);
  }
  return launch_dependent(skinny_gemm_kernel<R, M, false>, grid, dim3(kThreads), 0, stream, x, w, n, k, k_split, tiles,
                          skinny_early_w_enabled(), skinny_l2_next_enabled(), out);
}

// f(R, M) as integral constants for m = 1..8 x rows: M = m, R = rows_per_warp(m).
template <int N>
using Const = std::integral_constant<int, N>;
template <typename F>
cudaError_t with_rows(int m, F&& f) {
  switch (m) {
    case 1:
      return rows_per_warp(1) == kWideRowsPerWarp ? f(Const<kWideRowsPerWarp>{}, Const<1>{})
                                                  : f(Const<kRowsPerWarp>{}, Const<1>{});
    case 2: return f(Const<kRowsPerWarp>{}, Const<2>{});
    case 3: return f(Const<kRowsPerWarp>{}, Const<3>{});
    case 4: return f(Const<kRowsPerWarp>{}, Const<4>{});
    case 5: return f(Const<kRowsPerWarp>{}, Const<5>{});
    case 6: return f(Const<kRowsPerWarp>{}, Const<6>{});
    case 7: return f(Const<kRowsPerWarp>{}, Const<7>{});
    default: return f(Const<kRowsPerWarp>{}, Const<8>{});
  }
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Tile `tile` with FP8 weights: w e4m3 [n, k], w_scales [ceil(k / 128)][ceil(n / 128)].
template <int R, int M, bool kBf16Out>
__device__ __forceinline__ void skinny_tile_fp8(const uint16_t* x, const uint8_t* __restrict__ w,
                                                const float* __restrict__ w_scales, int n, int k, int k_split,
                                                void* __restrict__ out, int64_t tile,
                                                float (*partial)[kRowsPerWarp * kMaxRows]) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int groups_per_block = kWarpsPerBlock / k_split;
  const int64_t first_row = (tile * groups_per_block + warp / k_split) * R;
  const int slice = warp % k_split;
  const int64_t w_chunks = k / kFp8ChunkValues, x_chunks = k / 8;  // per row
  const int64_t begin = w_chunks * slice / k_split, end = w_chunks * (slice + 1) / k_split;

  const uint4* w_rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = first_row + r < n ? first_row + r : n - 1;
    w_rows[r] = reinterpret_cast<const uint4*>(w) + row * w_chunks;
  }
  const uint4* x_rows[M];
#pragma unroll
  for (int i = 0; i < M; ++i) x_rows[i] = reinterpret_cast<const uint4*>(x) + i * x_chunks;
  const float* const scale_col[1] = {w_scales + (first_row < n ? first_row : n - 1) / kFp8BlockValues};
  const int64_t scale_stride = (n + kFp8BlockValues - 1) / kFp8BlockValues;

  float acc[R][M];
  warp_dot_fp8<R, M, 1>(w_rows, x_rows, scale_col, scale_stride, begin, end, lane, acc);
  sum_slices<R, M>(acc, warp, lane, k_split, partial);
  store_tile<R, M, kBf16Out>(out, n, k_split, tile, partial);
}

// As skinny_gemm_kernel. 1 x row: at most 128 registers, so the 4 blocks per SM of the persistent grid fit.
template <int R, int M, bool kBf16Out>
__global__ void __launch_bounds__(kThreads, M == 1 ? 4 : 0)
    skinny_gemm_fp8_kernel(const uint16_t* x, const uint8_t* __restrict__ w,
                           const float* __restrict__ w_scales, int n, int k, int k_split, int64_t tiles,
                           void* __restrict__ out) {
  wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  __shared__ float partial[kWarpsPerBlock][kRowsPerWarp * kMaxRows];
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    skinny_tile_fp8<R, M, kBf16Out>(x, w, w_scales, n, k, k_split, out, tile, partial);
  }
}

template <int R, int M>
cudaError_t launch_rows_fp8(const uint16_t* x, const uint8_t* w, const float* w_scales, int n, int k, void* out,
                            bool bf16_out, cudaStream_t stream) {
  const int k_split =
      choose_k_split((static_cast<int64_t>(n) + kRowsPerWarp - 1) / kRowsPerWarp, k / kFp8ChunkValues);
  const int64_t row_groups = (static_cast<int64_t>(n) + R - 1) / R;
  const int groups_per_block = kWarpsPerBlock / k_split;
  const int64_t tiles = (row_groups + groups_per_block - 1) / groups_per_block;
  const int64_t blocks = skinny_grid_blocks(tiles, M);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  if (bf16_out) {
    return launch_dependent(skinny_gemm_fp8_kernel<R, M, true>, grid, dim3(kThreads), 0, stream, x, w, w_scales, n, k,
                            k_split, tiles, out);
  }
  return launch_dependent(skinny_gemm_fp8_kernel<R, M, false>, grid, dim3(kThreads), 0, stream, x, w, w_scales, n, k,
                          k_split, tiles, out);
}

}  // namespace


cudaError_t launch_skinny_gemm(const uint16_t* x, const uint16_t* w, int m, int n, int k, float* out_f32,
                               uint16_t* out_bf16, cudaStream_t stream, SkinnyWeightLoads loads) {
  if (m < 1 || m > kSkinnyGemmMaxRows || n < 0 || k <= 0 || k % 8 != 0) return cudaErrorInvalidValue;
  if ((out_f32 == nullptr) == (out_bf16 == nullptr)) return cudaErrorInvalidValue;
  if (x == nullptr || w == nullptr || !aligned(x, 16) || !aligned(w, 16)) return cudaErrorInvalidValue;
  if (!aligned(out_f32, alignof(float)) || !aligned(out_bf16, alignof(uint16_t))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  void* out = out_f32 != nullptr ? static_cast<void*>(out_f32) : static_cast<void*>(out_bf16);
  const bool bf16_out = out_bf16 != nullptr;
  return with_rows(m, [&](auto r, auto rows) {
    return launch_rows<decltype(r)::value, decltype(rows)::value>(x, w, n, k, out, bf16_out, stream, loads);
  });
}

cudaError_t launch_skinny_gemm_fp8(const uint16_t* x, const uint8_t* w, const float* w_scales, int m, int n, int k,
                                   float* out_f32, uint16_t* out_bf16, cudaStream_t stream) {
  if (m < 1 || m > kSkinnyGemmMaxRows || n < 0 || k <= 0 || k % kFp8ChunkValues != 0) return cudaErrorInvalidValue;
  if ((out_f32 == nullptr) == (out_bf16 == nullptr)) return cudaErrorInvalidValue;
  if (x == nullptr || w == nullptr || !aligned(x, 16) || !aligned(w, 16)) return cudaErrorInvalidValue;
  if (w_scales == nullptr || !aligned(w_scales, alignof(float))) return cudaErrorInvalidValue;
  if (!aligned(out_f32, alignof(float)) || !aligned(out_bf16, alignof(uint16_t))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  void* out = out_f32 != nullptr ? static_cast<void*>(out_f32) : static_cast<void*>(out_bf16);
  const bool bf16_out = out_bf16 != nullptr;
  return with_rows(m, [&](auto r, auto rows) {
    return launch_rows_fp8<decltype(r)::value, decltype(rows)::value>(x, w, w_scales, n, k, out, bf16_out, stream);
  });
}

}  // namespace fulcrum::gpu
