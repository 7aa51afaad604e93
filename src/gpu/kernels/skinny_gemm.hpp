#pragma once
// Skinny GEMM for decode: out [m, n] = x [m, k] @ w [n, k]^T with m in 1..8 rows, bf16 operands (uint16_t bits,
// row-major), fp32 accumulation, fp32 or bf16 output (row-major [m, n]). Memory-bound: W is read once with
// 16-byte loads that bypass L1 (x, at most 8 x k bf16, stays in L1 / L2). CPU reference:
// src/gpu/reference/skinny_gemm_reference.hpp.
//
// Deterministic and batch invariant: the work split (rows per warp, K slices per row) depends on n and k only,
// each lane sums its products in K order with fp32 FMAs, lanes are combined by a fixed butterfly and K slices in
// slice order. So row i of out is bitwise the same for every m and every run.
//
// Capture-safe: no allocation, no synchronization; the grid depends on n, k and the device only (a persistent
// grid: skinny_gemm_core.cuh).
// Returns cudaErrorInvalidValue for m outside 1..8, n < 0, k <= 0 or k % 8 != 0, x or w not 16-byte aligned,
// out not aligned to its element, or not exactly one of out_f32 / out_bf16 non-null. n == 0: no launch.
#include <cstdint>

#include <cuda_runtime.h>

namespace fulcrum::gpu {

constexpr int kSkinnyGemmMaxRows = 8;

// How W reaches the warps: kAuto takes bulk copies into shared memory where a tile of W rows fits (up to 96 KB a
// tile; FULCRUM_SKINNY_BULK=0 turns them off, for measurement), else 16-byte register loads; kRegisters always the
// latter; kBulk bulk copies wherever a tile fits, whatever the switches. All give the same bits (the same tiles,
// K slices and arithmetic): tests compare them. The expert GEMMs take the same choice (expert_skinny_gemm.hpp).
enum class SkinnyWeightLoads { kAuto, kRegisters, kBulk };

cudaError_t launch_skinny_gemm(const uint16_t* x, const uint16_t* w, int m, int n, int k, float* out_f32,
                               uint16_t* out_bf16, cudaStream_t stream,
                               SkinnyWeightLoads loads = SkinnyWeightLoads::kAuto);

// The same with FP8 weights (an FP8 checkpoint's dense projections): w e4m3 [n, k] row-major, w_scales fp32
// [ceil(k / 128)][ceil(n / 128)] (128 x 128 blocks, n blocks contiguous, as the FP8 grouped GEMM's;
// grouped_gemm_fp8.hpp), W[j][c] = e4m3(w[j][c]) * w_scales[c / 128][j / 128]: the last blocks may be partial
// (n and k need not be multiples of 128). x stays bf16; fp32 accumulation of 16-product partial sums, each scaled
// once by its block's scale (skinny_gemm_core.cuh). The same batch invariance (the work split from n and k only)
// and capture safety. CPU reference: reference::skinny_gemm_fp8. Returns cudaErrorInvalidValue as above, with
// k % 16 != 0 in place of k % 8 != 0, and for w_scales null or not 4-byte aligned.
cudaError_t launch_skinny_gemm_fp8(const uint16_t* x, const uint8_t* w, const float* w_scales, int m, int n, int k,
                                   float* out_f32, uint16_t* out_bf16, cudaStream_t stream);

}  // namespace fulcrum::gpu
