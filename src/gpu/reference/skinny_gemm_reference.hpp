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

}  // namespace fulcrum::gpu::reference
