#pragma once
// Skinny GEMMs on the tensor cores (dense_mma_gemm.cu: the dense projections of 2..32 rows that cuBLAS ran): a
// warp multiplies 16 W rows by up to 8 x NT activation rows over one K slice with mma.sync m16n8k16 (bf16 in, fp32
// accumulate), so a step of several rows is bound by the weight reads, not by FP32 FMAs (the FMA kernels of
// skinny_gemm_core.cuh issue one FMA per weight and row). Internal to that file. (First written for the expert and
// 1..8-row GEMMs at 4c9fe36 / 61f12f1, where it lost to the FMA kernels: docs/benchmarks.md.)
//
// Lane l = 4 g + t (g = l / 4, t = l % 4) loads W rows g and g + 8 of the warp's 16 and x row g of each 8-row
// tile, 16 bytes (8 values) at k = 32 b + 8 t of every 32-value k block b. The mma fragments want lane (g, t) to
// hold k = 2t, 2t + 1, 2t + 8, 2t + 9 of a 16-wide step; reading a lane's values 8t..8t+3 as those four (and
// 8t+4..8t+7 as the next step's) permutes k the same way in W and in x, which a dot product does not see. So every
// load is a plain coalesced 16-byte load and no shuffle is needed.
//
// Arithmetic: each output element is one dot product whose products are summed in k-block order by the mma
// chain of its K slice; it does not depend on the other x rows of its tile (a tensor core computes every element
// of D on its own), so a row's result is the same whatever rows run beside it, and the K slices follow from the
// shapes alone (the callers' choice). Slices are summed in slice order by the callers.
#include <cstdint>

#include <cuda_bf16.h>

#include "gpu/kernels/skinny_gemm_core.cuh"

namespace fulcrum::gpu::skinny_mma {

constexpr int kBlockValues = 32;  // k values of one block: 4 lanes x 8
constexpr int kStageBlocks = 4;   // k blocks per load stage; two stages in flight: 8 W loads per lane each
constexpr int kTripBlocks = 2 * kStageBlocks;
constexpr int kWarpRows = 16;     // W rows per warp (the mma's M)
constexpr int kTileRows = 8;      // x rows per tile (the mma's N)

// D += A B for one m16n8k16 step: a = W rows g / g + 8 at the lane's four k values, b = x row g at the same k.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One stage: the lane's W values of blocks [b, b + kStageBlocks) (zeros past block_end or past k: a slice's trip
// count, and so its mma sequence, follows from the shapes alone).
struct WStage {
  uint4 lo[kStageBlocks], hi[kStageBlocks];
};

__device__ __forceinline__ void load_stage(WStage& s, const uint16_t* __restrict__ w_lo,
                                           const uint16_t* __restrict__ w_hi, int64_t b, int64_t block_end, int k,
                                           int t) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int u = 0; u < kStageBlocks; ++u) {
    const int64_t at = (b + u) * kBlockValues + 8 * t;
    const bool load = b + u < block_end && at < k;
    s.lo[u] = load ? skinny::load_w(reinterpret_cast<const uint4*>(w_lo + at)) : zero;
    s.hi[u] = load ? skinny::load_w(reinterpret_cast<const uint4*>(w_hi + at)) : zero;
  }
}

// The stage's mma steps: x loads first (all of them, so they overlap), then two mma chains (even and odd blocks)
// so consecutive mma steps do not wait on each other.
template <int NT>
__device__ __forceinline__ void mma_stage(const WStage& s, const uint16_t* const (&x_rows)[NT], int64_t b,
                                          int64_t block_end, int k, int t, float (&acc)[2][NT][4]) {
  if (b >= block_end) return;  // warp-uniform: a stage wholly past the slice (the last trip's second)
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 x[kStageBlocks][NT];
#pragma unroll
  for (int u = 0; u < kStageBlocks; ++u) {
    const int64_t at = (b + u) * kBlockValues + 8 * t;
    const bool load = b + u < block_end && at < k;
#pragma unroll
    for (int j = 0; j < NT; ++j) x[u][j] = load ? __ldg(reinterpret_cast<const uint4*>(x_rows[j] + at)) : zero;
  }
#pragma unroll
  for (int u = 0; u < kStageBlocks; ++u) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      mma_bf16(acc[u % 2][j], s.lo[u].x, s.hi[u].x, s.lo[u].y, s.hi[u].y, x[u][j].x, x[u][j].y);
      mma_bf16(acc[u % 2][j], s.lo[u].z, s.hi[u].z, s.lo[u].w, s.hi[u].w, x[u][j].z, x[u][j].w);
    }
  }
}

// acc[j] = (W rows g, g + 8) . (x_rows[j]) over k blocks [block_begin, block_end) of a row of k values (k % 8 ==
// 0; the lanes of a last partial block past k read zeros). After the call lane (g, t) holds, for tile j,
// acc[j][0..1] = W row g times x rows 2t, 2t + 1 of the tile and acc[j][2..3] the same for W row g + 8.
// Two stages of W loads are in flight: the next stage is loaded before the current one is multiplied. The two mma
// chains are added at the end (even + odd), in that order.
template <int NT>
__device__ __forceinline__ void warp_mma(const uint16_t* __restrict__ w_lo, const uint16_t* __restrict__ w_hi,
                                         const uint16_t* const (&x_rows)[NT], int64_t block_begin, int64_t block_end,
                                         int k, int t, float (&acc)[NT][4]) {
  float chains[2][NT][4];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) chains[c][j][e] = 0.0f;
    }
  }
  WStage s0, s1;
  load_stage(s0, w_lo, w_hi, block_begin, block_end, k, t);
  for (int64_t b = block_begin; b < block_end; b += kTripBlocks) {
    load_stage(s1, w_lo, w_hi, b + kStageBlocks, block_end, k, t);
    mma_stage<NT>(s0, x_rows, b, block_end, k, t, chains);
    load_stage(s0, w_lo, w_hi, b + kTripBlocks, block_end, k, t);
    mma_stage<NT>(s1, x_rows, b + kStageBlocks, block_end, k, t, chains);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = __fadd_rn(chains[0][j][e], chains[1][j][e]);
  }
}

// K slices of a row of k values (1, 2 or 4 warps of a block share 16 W rows): more while the grid has fewer than
// skinny::kTargetWarps warps and every slice keeps at least one loop trip. From the shapes only.
inline int choose_k_split(int64_t warp_tiles, int k) {
  const int64_t blocks = (k + kBlockValues - 1) / kBlockValues;
  int k_split = 1;
  while (k_split < skinny::kMaxKSplit && warp_tiles * k_split < skinny::kTargetWarps &&
         blocks / (2 * k_split) >= kTripBlocks) {
    k_split *= 2;
  }
  return k_split;
}

// The block's warps hold K slices of the same 16 W rows in groups of k_split consecutive warps; after the call the
// slice-0 warp of each group holds the group's sums, slice 0 + slice 1 + ... in that order. Every thread of the
// block calls it (it synchronizes). partial: [warps][NT * 4][32] floats.
template <int NT>
__device__ __forceinline__ void sum_slices(float (&acc)[NT][4], int warp, int lane, int k_split,
                                           float (*partial)[NT * 4][32]) {
  if (k_split == 1) return;
  const int slice = warp % k_split;
  if (slice != 0) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) partial[warp][j * 4 + e][lane] = acc[j][e];
    }
  }
  __syncthreads();
  if (slice == 0) {
    for (int s = 1; s < k_split; ++s) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = __fadd_rn(acc[j][e], partial[warp + s][j * 4 + e][lane]);
      }
    }
  }
  __syncthreads();  // partial is rewritten by the next tile
}

}  // namespace fulcrum::gpu::skinny_mma
