// Expert skinny GEMMs with bf16 weights on the tensor cores (expert_skinny_gemm.hpp's bf16 path; the warp's
// arithmetic is skinny_mma_core.cuh's). A persistent 1-D grid over the (active slot, column tile) items, as the
// FMA kernels: an item is one slot's rows, 8 x NT at a time, against one column tile of the block's warps. A warp
// owns 16 W rows: plain, 16 consecutive output columns; SwiGLU, 8 output columns j.. as gate rows j.. (the mma's
// rows 0..7) and up rows I + j.. (rows 8..15), so lane (g, t) holds the gate and the up sum of the same column and
// row and forms the activation in registers.
#include <algorithm>

#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/expert_mma_gemm.hpp"
#include "gpu/kernels/skinny_mma_core.cuh"

namespace fulcrum::gpu {
namespace {

using namespace skinny_mma;
using skinny::kThreads;
using skinny::kWarpsPerBlock;
using skinny::to_bf16;

__device__ __forceinline__ float bf16_round(float v) { return __uint_as_float(static_cast<uint32_t>(to_bf16(v)) << 16); }

template <bool kSwiGlu>
constexpr int kColsPerWarp = kSwiGlu ? kWarpRows / 2 : kWarpRows;

// Block b takes items [b * items / grid, (b + 1) * items / grid) of the active slots' items, slot-major (the
// blocks' shares differ by at most one item). No register bound: at 128 (4 blocks per SM) the 16 W loads in flight
// per lane spill; at ~164, 3 blocks fit, 12 warps x 8 KB in flight per SM.
template <bool kSwiGlu, int NT>
__global__ void __launch_bounds__(kThreads) expert_mma_kernel(const ExpertSkinnyArgs a, int k_split, int tiles) {
  wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  __shared__ float partial[kWarpsPerBlock][NT * 4][32];
  const int64_t items = static_cast<int64_t>(__ldg(a.active)) * tiles;
  const int64_t item_begin = items * blockIdx.x / gridDim.x, item_end = items * (blockIdx.x + 1) / gridDim.x;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  const int groups_per_block = kWarpsPerBlock / k_split, group = warp / k_split, slice = warp % k_split;
  constexpr int kCols = kColsPerWarp<kSwiGlu>;
  const int64_t blocks = (a.k + kBlockValues - 1) / kBlockValues;
  const int64_t block_begin = blocks * slice / k_split, block_end = blocks * (slice + 1) / k_split;
  int slot_index = -1, row_begin = 0, row_end = 0;
  const uint16_t* w = nullptr;
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int y = static_cast<int>(item / tiles);
    if (y != slot_index) {
      slot_index = y;
      const int slot = __ldg(a.active + 1 + y);
      row_begin = __ldg(a.offsets + slot);
      row_end = __ldg(a.offsets + slot + 1);
      w = a.weights[slot];
    }
    const int64_t first_col = ((item % tiles) * groups_per_block + group) * kCols;
    // The lane's two W rows; columns past n read the last column's rows and store nothing.
    int64_t lo_row, hi_row;
    if constexpr (kSwiGlu) {
      lo_row = min(first_col + g, static_cast<int64_t>(a.n - 1));
      hi_row = a.n + lo_row;
    } else {
      lo_row = min(first_col + g, static_cast<int64_t>(a.n - 1));
      hi_row = min(first_col + 8 + g, static_cast<int64_t>(a.n - 1));
    }
    const uint16_t* w_lo = w + lo_row * a.k;
    const uint16_t* w_hi = w + hi_row * a.k;
    for (int r0 = row_begin; r0 < row_end; r0 += kTileRows * NT) {
      // x row g of each tile (rows past the slot's read its last row and store nothing).
      const uint16_t* x_rows[NT];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int r = min(r0 + j * kTileRows + g, row_end - 1);
        const int64_t src = a.row_source != nullptr ? __ldg(a.row_source + r) : r;
        x_rows[j] = a.x + src * a.k;
      }
      float acc[NT][4];
      warp_mma<NT>(w_lo, w_hi, x_rows, block_begin, block_end, a.k, t, acc);
      sum_slices<NT>(acc, warp, lane, k_split, partial);
      if (slice != 0) continue;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = r0 + j * kTileRows + 2 * t + e;
          if (r >= row_end) continue;
          uint16_t* out_row = a.out + static_cast<int64_t>(r) * a.n;
          if constexpr (kSwiGlu) {
            const int64_t col = first_col + g;
            if (col < a.n) {
              const float gate = bf16_round(acc[j][e]), up = bf16_round(acc[j][2 + e]);
              out_row[col] = to_bf16(gate / (1.0f + expf(-gate)) * up);
            }
          } else {
            if (first_col + g < a.n) out_row[first_col + g] = to_bf16(acc[j][e]);
            if (first_col + 8 + g < a.n) out_row[first_col + 8 + g] = to_bf16(acc[j][2 + e]);
          }
        }
      }
    }
  }
}

// Blocks of the kernel resident per SM (registers bound it), read once per kernel.
template <bool kSwiGlu, int NT>
int resident_blocks_per_sm() {
  static const int blocks = [] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, expert_mma_kernel<kSwiGlu, NT>, kThreads, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      return 1;
    }
    return std::max(1, n);
  }();
  return blocks;
}

template <bool kSwiGlu, int NT>
cudaError_t launch_tiles(const ExpertSkinnyArgs& a, cudaStream_t stream) {
  constexpr int kCols = kColsPerWarp<kSwiGlu>;
  const int64_t col_tiles = (static_cast<int64_t>(a.n) + kCols - 1) / kCols;  // warp tiles per slot
  // The K split as if every row had its own slot (at most max_rows slots have rows): shapes only.
  const int k_split = choose_k_split(col_tiles * a.max_rows, a.k);
  const int groups_per_block = kWarpsPerBlock / k_split;
  const int64_t tiles = (col_tiles + groups_per_block - 1) / groups_per_block;
  const int64_t max_items = tiles * std::min(a.max_rows, a.num_slots);
  const int64_t blocks = skinny::skinny_grid_blocks(max_items, NT == 1 ? 1 : 8, resident_blocks_per_sm<kSwiGlu, NT>());
  if (tiles > INT32_MAX || blocks > INT32_MAX) return cudaErrorInvalidValue;
  return launch_dependent(expert_mma_kernel<kSwiGlu, NT>, dim3(static_cast<unsigned>(blocks)),
                          dim3(kThreads), 0, stream, a, k_split, static_cast<int>(tiles));
}

}  // namespace

cudaError_t launch_expert_mma_gemm(const ExpertSkinnyArgs& a, cudaStream_t stream) {
  const int slot_rows = a.max_slot_rows > 0 ? std::min(a.max_slot_rows, a.max_rows) : a.max_rows;
  // Passes of 8 rows for slots of at most 8, else of 16 (at 32 the registers spill).
  if (slot_rows <= kTileRows) return a.swiglu ? launch_tiles<true, 1>(a, stream) : launch_tiles<false, 1>(a, stream);
  return a.swiglu ? launch_tiles<true, 2>(a, stream) : launch_tiles<false, 2>(a, stream);
}

}  // namespace fulcrum::gpu
