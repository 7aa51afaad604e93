#pragma once
// What the skinny GEMMs share (skinny_gemm.cu: one dense matrix; expert_skinny_gemm.cu: a matrix per expert
// slot): the warp's dot products of R (4 or 8) W rows with up to 8 x rows over one K slice, and the block's sum
// of the K slices in slice order; the same dot products with FP8 (e4m3, 128 x 128 block-scaled) weights at the
// end (warp_dot_fp8). Internal to those files.
//
// Arithmetic, the same for every M and R (so a row's result does not depend on how many rows ran with it, nor
// on how rows are grouped into warps): lane l of a warp takes 16-byte chunks c = begin + l, begin + l + 32, ...
// of its slice (8 bf16 each), two chunks per row per loop trip, and accumulates with fp32 FMAs in K order; lanes
// are combined by an xor butterfly, slices in slice order; the K slices follow from n / 4 and k alone
// (choose_k_split). R = 8 (for 1 x row: at 2 the registers cost more than it gains, measured) keeps 16 independent 16-byte W loads in
// flight per lane instead of 8 and halves the block synchronizations per byte of W. W is read once, so its loads
// bypass L1 (x, a few rows, stays in L1 / L2; an earlier kernel's output, so loaded as dependent_launch.cuh's
// load_produced says).
#include <cstdint>

#include <cuda_bf16.h>

#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/skinny_plan.hpp"

namespace fulcrum::gpu::skinny {

// A 16-byte load of W, read once: through the non-coherent path without allocating in L1.
__device__ __forceinline__ uint4 load_w(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// bf16 value 2j of a 16-byte chunk is the low half of word j (little endian), value 2j + 1 the high half.
__device__ __forceinline__ float lo_bf16(uint32_t word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float hi_bf16(uint32_t word) { return __uint_as_float(word & 0xffff0000u); }
__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}
__device__ __forceinline__ uint16_t to_bf16(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }


// acc[r][i] += w[r] . x[i] over one chunk of 8 values, in value order (explicit FMAs: the same arithmetic for
// every M).
template <int R, int M>
__device__ __forceinline__ void fma_chunk(float (&acc)[R][M], const uint4 (&w)[R], const uint4 (&x)[M]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const uint32_t xw = word_of(x[i], j);
        const float xv = half == 0 ? lo_bf16(xw) : hi_bf16(xw);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t ww = word_of(w[r], j);
          const float wv = half == 0 ? lo_bf16(ww) : hi_bf16(ww);
          acc[r][i] = __fmaf_rn(wv, xv, acc[r][i]);
        }
      }
    }
  }
}

// Every lane's acc summed over the warp by an xor butterfly: every lane ends with the warp's sums (a + b == b + a).
template <int R, int M>
__device__ __forceinline__ void warp_sum(float (&acc)[R][M]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        acc[r][i] = __fadd_rn(acc[r][i], __shfl_xor_sync(0xffffffffu, acc[r][i], offset));
      }
    }
  }
}

// warp_dot's sums with the W rows in shared memory (bulk-copied tiles: skinny_gemm.cu, expert_skinny_gemm.cu):
// plain loads, a lane's chunks in the same ascending order and the same FMAs, so the same bits.
template <int R, int M>
__device__ __forceinline__ void warp_dot_shared(const uint4* const (&w_rows)[R], const uint4* const (&x_rows)[M],
                                                int64_t begin, int64_t end, int lane, float (&acc)[R][M]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.0f;
  }
  for (int64_t c = begin + lane; c < end; c += 32) {
    uint4 wv[R], xv[M];
#pragma unroll
    for (int r = 0; r < R; ++r) wv[r] = w_rows[r][c];
#pragma unroll
    for (int i = 0; i < M; ++i) xv[i] = load_produced(x_rows[i] + c);
    fma_chunk<R, M>(acc, wv, xv);
  }
  warp_sum<R, M>(acc);
}

// The W loads of warp_dot's first loop trip (chunks begin + lane + 32 t, t < kChunksPerTrip, of each row), for a
// kernel that issues them before its griddepcontrol.wait: no kernel of a step writes the weights, so their first
// bytes may arrive while the kernel before is finishing instead of after it (the load latency of a short kernel's
// first trip is a good part of its time at decode sizes). A lane loads them only where its slice has a full first
// trip, as warp_dot's loop does; warp_dot then starts from them. The loads and the arithmetic are warp_dot's own,
// so the results do not change.
template <int R>
struct FirstTrip {
  uint4 w[kChunksPerTrip][R];
};

__device__ __forceinline__ bool has_full_first_trip(int64_t begin, int64_t end, int lane) {
  return begin + lane + 32 * (kChunksPerTrip - 1) < end;
}

template <int R>
__device__ __forceinline__ void load_first_trip(const uint4* const (&w_rows)[R], int64_t begin, int64_t end, int lane,
                                                FirstTrip<R>& trip) {
  if (!has_full_first_trip(begin, end, lane)) return;
#pragma unroll
  for (int t = 0; t < kChunksPerTrip; ++t) {
#pragma unroll
    for (int r = 0; r < R; ++r) trip.w[t][r] = load_w(w_rows[r] + begin + lane + 32 * t);
  }
}

// The same chunks asked of L2 without waiting (no registers held): for a unit that starts after a synchronization.
template <int R>
__device__ __forceinline__ void prefetch_first_trip_l2(const uint4* const (&w_rows)[R], int64_t begin, int64_t end,
                                                       int lane) {
  if (!has_full_first_trip(begin, end, lane)) return;
#pragma unroll
  for (int t = 0; t < kChunksPerTrip; ++t) {
#pragma unroll
    for (int r = 0; r < R; ++r) asm volatile("prefetch.global.L2 [%0];" ::"l"(w_rows[r] + begin + lane + 32 * t));
  }
}

// One loop trip of warp_dot from its W chunks: chunks c + 32 t of the x rows, then the FMAs, t in order.
template <int R, int M>
__device__ __forceinline__ void fma_trip(float (&acc)[R][M], const uint4 (&wv)[kChunksPerTrip][R],
                                         const uint4* const (&x_rows)[M], int64_t c) {
#pragma unroll
  for (int t = 0; t < kChunksPerTrip; ++t) {
    uint4 xv[M];
#pragma unroll
    for (int i = 0; i < M; ++i) xv[i] = load_produced(x_rows[i] + c + 32 * t);
    fma_chunk<R, M>(acc, wv[t], xv);
  }
}

// acc[r][i] = w_rows[r] . x_rows[i] over chunks [begin, end) of a row, summed over the warp: every lane ends
// with the warp's sums (a + b == b + a in the butterfly). With kFirst, the first trip's W chunks are those
// load_first_trip put in `first` for the same rows and slice (a compile-time choice: a runtime one keeps `first`'s
// registers live through the rest of the call, measured 128 -> 255 registers in the expert kernel).
template <int R, int M, bool kFirst = false>
__device__ __forceinline__ void warp_dot(const uint4* const (&w_rows)[R], const uint4* const (&x_rows)[M],
                                         int64_t begin, int64_t end, int lane, float (&acc)[R][M],
                                         const FirstTrip<R>* first = nullptr) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.0f;
  }
  int64_t c = begin + lane;
  if (kFirst && has_full_first_trip(begin, end, lane)) {
    fma_trip<R, M>(acc, first->w, x_rows, c);
    c += 32 * kChunksPerTrip;
  }
  for (; c + 32 * (kChunksPerTrip - 1) < end; c += 32 * kChunksPerTrip) {
    uint4 wv[kChunksPerTrip][R];
#pragma unroll
    for (int t = 0; t < kChunksPerTrip; ++t) {
#pragma unroll
      for (int r = 0; r < R; ++r) wv[t][r] = load_w(w_rows[r] + c + 32 * t);
    }
    fma_trip<R, M>(acc, wv, x_rows, c);
  }
  for (; c < end; c += 32) {  // the slice's last chunk of this lane when its count is odd
    uint4 wv[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wv[r] = load_w(w_rows[r] + c);
    uint4 xv[M];
#pragma unroll
    for (int i = 0; i < M; ++i) xv[i] = load_produced(x_rows[i] + c);
    fma_chunk<R, M>(acc, wv, xv);
  }
  warp_sum<R, M>(acc);
}

// The block's K slices summed in slice order: warp w holds slice w % k_split of row group w / k_split; after
// the call partial[g * k_split][r * M + i] holds row group g's full sum for (W row r, x row i). Every thread of
// the block calls it (it synchronizes); callers synchronize again before reusing `partial`.
static_assert(kWideRowsPerWarp * 2 <= kRowsPerWarp * kMaxRows, "partial holds R x M sums for both R");
template <int R, int M>
__device__ __forceinline__ void sum_slices(const float (&acc)[R][M], int warp, int lane, int k_split,
                                           float (*partial)[kRowsPerWarp * kMaxRows]) {
  static_assert(R * M <= kRowsPerWarp * kMaxRows, "one partial sum per lane");
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      if (lane == r * M + i) partial[warp][r * M + i] = acc[r][i];
    }
  }
  __syncthreads();
  if (k_split == 1) return;
  const int t = static_cast<int>(threadIdx.x), groups = kWarpsPerBlock / k_split;
  float sum = 0.0f;
  const bool mine = t < groups * R * M;
  const int group = t / (R * M), j = t % (R * M);
  if (mine) {
    sum = partial[group * k_split][j];
    for (int s = 1; s < k_split; ++s) sum = __fadd_rn(sum, partial[group * k_split + s][j]);
  }
  __syncthreads();
  if (mine) partial[group * k_split][j] = sum;
  __syncthreads();
}

// ---- FP8 weights: e4m3 with 128 x 128 block scales ----
// A W chunk is 16 e4m3 weights (one 16-byte load, twice the weights of a bf16 chunk) against 16 bf16 x values (two
// 16-byte loads); 16 divides 128, so chunk c lies inside scale block c / 8 of its row. Lanes, trips, the lane
// butterfly and the slice sums are the bf16 ones, counted in FP8 chunks. Per chunk and (W row, x row) the 16
// products (exact in fp32: 4 x 8 significant bits) are summed by fp32 FMAs in K order, then folded into the
// accumulator by one FMA with the block's scale, acc = sum16 * scale + acc: the scale costs 1 FMA per 16
// products. (A 128-wide block spans 8 lanes of a coalesced load: summing it whole before scaling would cost 3
// shuffles per sum and block, about the FMAs' own issue time at 8 x rows.) The same arithmetic for every M.
constexpr int kFp8ChunkValues = 16;
constexpr int kFp8BlockValues = 128;
constexpr int kFp8ChunksPerBlock = kFp8BlockValues / kFp8ChunkValues;

// e4m3 values 2j and 2j + 1 of a 32-bit word (bytes 2j, 2j + 1; j is 0 or 1) as fp32, exactly (e4m3 values are
// f16 values): one cvt to f16x2, two to f32.
__device__ __forceinline__ void e4m3_pair_to_f32(uint32_t word, int j, float& lo, float& hi) {
  const uint16_t pair = static_cast<uint16_t>(j == 0 ? word : word >> 16);
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(pair));
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(lo), "=f"(hi)
      : "r"(halves));
}

// acc[r][i] += scale[r / (R / S)] * (w[r] . x[i]) over one FP8 chunk; x[i][0] holds values 0..7, x[i][1] 8..15.
// S = 1 or 2 scale blocks among the R rows (the first R / S rows in the first).
template <int R, int M, int S>
__device__ __forceinline__ void fma_chunk_fp8(float (&acc)[R][M], const uint4 (&w)[R], const uint4 (&x)[M][2],
                                              const float (&scale)[S]) {
  static_assert(R % S == 0, "whole rows per scale block");
  float sum[R][M];
#pragma unroll
  for (int pair = 0; pair < kFp8ChunkValues / 2; ++pair) {  // values 2 pair, 2 pair + 1
    float w_lo[R], w_hi[R];
#pragma unroll
    for (int r = 0; r < R; ++r) e4m3_pair_to_f32(word_of(w[r], pair / 2), pair % 2, w_lo[r], w_hi[r]);
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const uint32_t xw = word_of(x[i][pair / 4], pair % 4);
      const float x_lo = lo_bf16(xw), x_hi = hi_bf16(xw);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        sum[r][i] = pair == 0 ? __fmul_rn(w_lo[r], x_lo) : __fmaf_rn(w_lo[r], x_lo, sum[r][i]);
        sum[r][i] = __fmaf_rn(w_hi[r], x_hi, sum[r][i]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = __fmaf_rn(sum[r][i], scale[r / (R / S)], acc[r][i]);
  }
}

// warp_dot for FP8 weights: w_rows[r] points at an e4m3 row (16 weights per uint4), x_rows[i] at a bf16 row (8
// values per uint4), [begin, end) counts FP8 chunks. scale_cols[s] (s < S) points at the scale of k block 0 for
// the rows of scale block s; k block b's is scale_cols[s][b * scale_stride].
template <int R, int M, int S>
__device__ __forceinline__ void warp_dot_fp8(const uint4* const (&w_rows)[R], const uint4* const (&x_rows)[M],
                                             const float* const* scale_cols, int64_t scale_stride,
                                             int64_t begin, int64_t end, int lane, float (&acc)[R][M]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.0f;
  }
  const auto block_of = [](int64_t chunk) { return static_cast<int64_t>(static_cast<uint64_t>(chunk) / kFp8ChunksPerBlock); };
  int64_t c = begin + lane;
  for (; c + 32 * (kChunksPerTrip - 1) < end; c += 32 * kChunksPerTrip) {
    uint4 wv[kChunksPerTrip][R];
    float sv[kChunksPerTrip][S];
#pragma unroll
    for (int t = 0; t < kChunksPerTrip; ++t) {
#pragma unroll
      for (int r = 0; r < R; ++r) wv[t][r] = load_w(w_rows[r] + c + 32 * t);
    }
#pragma unroll
    for (int t = 0; t < kChunksPerTrip; ++t) {
#pragma unroll
      for (int s = 0; s < S; ++s) sv[t][s] = __ldg(scale_cols[s] + block_of(c + 32 * t) * scale_stride);
    }
#pragma unroll
    for (int t = 0; t < kChunksPerTrip; ++t) {
      uint4 xv[M][2];
#pragma unroll
      for (int i = 0; i < M; ++i) {
        xv[i][0] = load_produced(x_rows[i] + 2 * (c + 32 * t));
        xv[i][1] = load_produced(x_rows[i] + 2 * (c + 32 * t) + 1);
      }
      fma_chunk_fp8<R, M, S>(acc, wv[t], xv, sv[t]);
    }
  }
  for (; c < end; c += 32) {  // the slice's last chunk of this lane when its count is odd
    uint4 wv[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wv[r] = load_w(w_rows[r] + c);
    float sv[S];
#pragma unroll
    for (int s = 0; s < S; ++s) sv[s] = __ldg(scale_cols[s] + block_of(c) * scale_stride);
    uint4 xv[M][2];
#pragma unroll
    for (int i = 0; i < M; ++i) {
      xv[i][0] = load_produced(x_rows[i] + 2 * c);
      xv[i][1] = load_produced(x_rows[i] + 2 * c + 1);
    }
    fma_chunk_fp8<R, M, S>(acc, wv, xv, sv);
  }
  warp_sum<R, M>(acc);
}

}  // namespace fulcrum::gpu::skinny
