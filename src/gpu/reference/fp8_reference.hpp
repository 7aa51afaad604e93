#pragma once
// CPU references of the FP8 expert path, in plain C++: the 1x128 activation quantization
// (src/gpu/kernels/fp8_quant.cu, contract in gpu/kernels/fp8_quant.hpp) and the FP8 blockwise grouped GEMM
// (src/gpu/cutlass/grouped_gemm_fp8*.cu, contract in gpu/cutlass/grouped_gemm_fp8.hpp). bf16 is uint16_t bits,
// e4m3 uint8_t bits (float8_e4m3fn), all tensors dense row-major with absolute row indices, offsets [G + 1]
// non-decreasing; group g = rows [offsets[g], offsets[g + 1]), first row f, m rows, Kb = cols / 128 (or K / 128):
// its scales sa(r, kb) at scales[f * Kb + kb * m + (r - f)]. Only the rows of some group are written.
#include <cstdint>
#include <span>

namespace fulcrum::gpu::reference {

constexpr int kFp8Block = 128;

// Per (row, 128-column block): amax = max |x|, scale = amax / 448 (fp32), q = e4m3(x * (448 / amax)) with
// 448 / amax one fp32 division, x * that one fp32 rounding, then round to nearest even saturating at +-448;
// amax == 0: scale 0 and q 0. Bitwise what launch_quantize_rows_fp8 writes. x [rows, cols] bf16, q [rows, cols],
// scales [offsets[G] * Kb] (offsets[0] * Kb onwards written); cols % 128 == 0.
void quantize_rows_fp8(std::span<const uint16_t> x, int cols, std::span<const int32_t> offsets, std::span<uint8_t> q,
                       std::span<float> scales);

// a = bf16(silu(g) * u) for h [rows, 2 cols] bf16 (gate | up), silu(g) = g / (1 + exp(-g)) in fp32 (std::exp),
// the rows of every group into a [rows, cols] bf16 (other rows untouched).
void swiglu_bf16(std::span<const uint16_t> h, int cols, std::span<const int32_t> offsets, std::span<uint16_t> a);

// swiglu_bf16, then quantize_rows_fp8 of its result. The GPU's expf may differ from std::exp by an ulp or two
// (CUDA's documented expf error: 2 ulp), which changes a bf16 activation where the fp32 product lies that close
// to a bf16 rounding midpoint: q then within one e4m3 step, and the scale off where it was the block's amax.
void swiglu_quantize_fp8(std::span<const uint16_t> h, int cols, std::span<const int32_t> offsets, std::span<uint8_t> q,
                         std::span<float> scales);

// d[r][n] = sum_kb sa(r, kb) * sb_g[kb][n / 128] * sum_{k in block kb} a[r][k] * b_g[n][k], with the e4m3 values
// dequantized exactly, each block's sum in double (exact: e4m3 products span < 2^43), scaled and summed over
// the blocks in double, returned as fp32 (before the GPU's bf16 rounding). a [rows, K] e4m3, a_scales in the
// grouped layout above, b [num_b, N, K] e4m3, b_scales [num_b, Kb, N / 128] fp32; group g uses b[g % num_b].
// d [rows, N]; abs_sums (empty: not written) [rows, N] = sum_kb |sa sb| sum_k |a b|, the scale of the GPU's
// accumulation error. N % 128 == 0, K % 128 == 0.
void fp8_grouped_gemm(std::span<const uint8_t> a, std::span<const float> a_scales, std::span<const int32_t> offsets,
                      std::span<const uint8_t> b, std::span<const float> b_scales, int num_b, int n, int k,
                      std::span<float> d, std::span<float> abs_sums = {});

}  // namespace fulcrum::gpu::reference
