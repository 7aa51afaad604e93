#pragma once
// CPU reference of the skinny GEMM (src/gpu/kernels/skinny_gemm.cu), in plain C++: out [m, n] = x [m, k] @
// w [n, k]^T with bf16 operands (uint16_t bits, row-major). Each product of two bf16 values is exact in fp32 and
// in double; the reference sums them in double and rounds once to fp32, so it is the correctly rounded result
// and the kernel's error is all its own (fp32 accumulation order).
#include <cstdint>
#include <span>

namespace fulcrum::gpu::reference {

// out [m, n] fp32; abs_sums (empty: not written) [m, n] = sum_k |x[i, k]| |w[j, k]|, the scale of the kernel's
// accumulation error.
void skinny_gemm(std::span<const uint16_t> x, std::span<const uint16_t> w, int m, int n, int k, std::span<float> out,
                 std::span<float> abs_sums = {});

// FP8 weights (the FP8 skinny GEMMs: expert_skinny_gemm.hpp's fp8_weights, skinny_gemm.hpp's
// launch_skinny_gemm_fp8): w e4m3 bytes [n, k], w_scales fp32 [ceil(k / 128)][ceil(n / 128)] (128 x 128 blocks,
// the last ones partial when 128 does not divide k or n), W[j][c] = e4m3(w[j][c]) * w_scales[c / 128][j / 128].
// Per row and 128-wide block, the products of x and the e4m3 values (exact in double) are summed in double, then
// scaled and added in double; one rounding to fp32. abs_sums as above, of |x| |W|. e4m3 NaN bytes (0x7f, 0xff)
// give NaN.
void skinny_gemm_fp8(std::span<const uint16_t> x, std::span<const uint8_t> w, std::span<const float> w_scales, int m,
                     int n, int k, std::span<float> out, std::span<float> abs_sums = {});

}  // namespace fulcrum::gpu::reference
