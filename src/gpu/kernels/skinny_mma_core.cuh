#pragma once
// Skinny GEMMs on the tensor cores (dense_mma_gemm.cu: the dense projections of 2..32 rows that cuBLAS runs): a
// warp multiplies 16 W rows by up to 8 x NT activation rows over one K slice with mma.sync m16n8k16 (bf16 in, fp32
// accumulate), so a step of several rows is bound by the weight reads, not by FP32 FMAs (the FMA kernels of
// skinny_gemm_core.cuh issue one FMA per weight and row). Internal to that file.
//
// Lane l = 4 g + t (g = l / 4, t = l % 4) loads W rows g and g + 8 of the warp's 16 and x row g of each 8-row
// tile, 16 bytes (8 values) at k = 32 b + 8 t of every 32-value k block b. The mma fragments want lane (g, t) to
// hold k = 2t, 2t + 1, 2t + 8, 2t + 9 of a 16-wide step; reading a lane's values 8t..8t+3 as those four (and
// 8t+4..8t+7 as the next step's) permutes k the same way in W and in x, which a dot product does not see. So every
// load is a plain coalesced 16-byte load and no shuffle is needed.
//
// Loads: a stage is SB k blocks of W *and* of x, issued together, two stages in flight: the stage being multiplied
// was loaded a whole stage earlier. (A first version, f8c94a7, loaded x only when its stage was multiplied, so every
// stage waited one L2 round trip for x, and ran slower than cuBLAS in the decode step: docs/benchmarks.md.) x comes
// from the kernel before (a dependent launch), so it is read through load_produced, never the non-coherent path.
//
// Arithmetic: each output element is one dot product whose products are summed in k-block order by the mma
// chains of its K slice; it does not depend on the other x rows of its tile (a tensor core computes every element
// of D on its own), so a row's result is the same whatever rows run beside it, and the K slices follow from the
// shapes alone (choose_k_split). Slices are summed in slice order (sum_slices).
#include <cstdint>

#include <cuda_bf16.h>

#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/skinny_gemm_core.cuh"

namespace fulcrum::gpu::skinny_mma {

constexpr int kBlockValues = 32;  // k values of one block: 4 lanes x 8
constexpr int kWarpRows = 16;     // W rows per warp (the mma's M)
constexpr int kTileRows = 8;      // x rows per tile (the mma's N)
constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = 32 * kWarpsPerBlock;
constexpr int kMaxKSplit = kWarpsPerBlock;
constexpr int64_t kTargetWarps = 4096;
// k blocks per stage: 4 up to 16 x rows, 2 beyond (x's registers grow with the tiles).
template <int NT>
constexpr int stage_blocks() {
  return NT <= 2 ? 4 : 2;
}

// D += A B for one m16n8k16 step: a = W rows g / g + 8 at the lane's four k values, b = x row g at the same k.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One stage: the lane's W and x values of k blocks [b, b + SB) (zeros past the slice or past k: a slice's trip
// count, and so its mma sequence, follows from the shapes alone).
template <int NT, int SB>
struct Stage {
  uint4 lo[SB], hi[SB], x[SB][NT];
};

template <int NT, int SB>
__device__ __forceinline__ void load_stage(Stage<NT, SB>& s, const uint16_t* w_lo, const uint16_t* w_hi,
                                           const uint16_t* const (&x_rows)[NT], int64_t b, int64_t block_end, int k,
                                           int t) {
  if (b >= block_end) return;  // warp-uniform: a stage wholly past the slice (never multiplied)
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int u = 0; u < SB; ++u) {
    const int64_t at = (b + u) * kBlockValues + 8 * t;
    const bool load = b + u < block_end && at < k;
    s.lo[u] = load ? skinny::load_w(reinterpret_cast<const uint4*>(w_lo + at)) : zero;
    s.hi[u] = load ? skinny::load_w(reinterpret_cast<const uint4*>(w_hi + at)) : zero;
#pragma unroll
    for (int j = 0; j < NT; ++j) s.x[u][j] = load ? load_produced(reinterpret_cast<const uint4*>(x_rows[j] + at)) : zero;
  }
}

// The stage's mma steps in two chains (even and odd blocks), so consecutive steps do not wait on each other.
template <int NT, int SB>
__device__ __forceinline__ void mma_stage(const Stage<NT, SB>& s, int64_t b, int64_t block_end,
                                          float (&chains)[2][NT][4]) {
  if (b >= block_end) return;
#pragma unroll
  for (int u = 0; u < SB; ++u) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      mma_bf16(chains[u % 2][j], s.lo[u].x, s.hi[u].x, s.lo[u].y, s.hi[u].y, s.x[u][j].x, s.x[u][j].y);
      mma_bf16(chains[u % 2][j], s.lo[u].z, s.hi[u].z, s.lo[u].w, s.hi[u].w, s.x[u][j].z, s.x[u][j].w);
    }
  }
}

// acc[j] = (W rows g, g + 8) . (x_rows[j]) over k blocks [block_begin, block_end) of a row of k values (k % 8 ==
// 0; the lanes of a last partial block past k read zeros). After the call lane (g, t) holds, for tile j,
// acc[j][0..1] = W row g times x rows 2t, 2t + 1 of the tile and acc[j][2..3] the same for W row g + 8. The two
// chains are added at the end (even + odd), in that order.
template <int NT>
__device__ __forceinline__ void warp_mma(const uint16_t* w_lo, const uint16_t* w_hi,
                                         const uint16_t* const (&x_rows)[NT], int64_t block_begin, int64_t block_end,
                                         int k, int t, float (&acc)[NT][4]) {
  constexpr int SB = stage_blocks<NT>();
  float chains[2][NT][4];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) chains[c][j][e] = 0.0f;
    }
  }
  Stage<NT, SB> s0, s1;
  load_stage<NT, SB>(s0, w_lo, w_hi, x_rows, block_begin, block_end, k, t);
  for (int64_t b = block_begin; b < block_end; b += 2 * SB) {
    load_stage<NT, SB>(s1, w_lo, w_hi, x_rows, b + SB, block_end, k, t);
    mma_stage<NT, SB>(s0, b, block_end, chains);
    load_stage<NT, SB>(s0, w_lo, w_hi, x_rows, b + 2 * SB, block_end, k, t);
    mma_stage<NT, SB>(s1, b + SB, block_end, chains);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = __fadd_rn(chains[0][j][e], chains[1][j][e]);
  }
}

// K slices of a row of k values (1, 2 or 4 warps of a block share 16 W rows): more while the grid has fewer than
// kTargetWarps warps and every slice keeps at least one loop trip of the widest stages. From n and k only, the same
// for every tile count: a block's chain (even or odd) is its offset in the slice for either stage width, so a row's
// bits do not depend on m.
inline int choose_k_split(int64_t warp_tiles, int k) {
  constexpr int kTripBlocks = 2 * stage_blocks<1>();
  const int64_t blocks = (k + kBlockValues - 1) / kBlockValues;
  int k_split = 1;
  while (k_split < kMaxKSplit && warp_tiles * k_split < kTargetWarps && blocks / (2 * k_split) >= kTripBlocks) {
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
