#pragma once
// Dense bf16 GEMM on the tensor cores for a few rows: out [m, n] = x [m, k] @ w [n, k]^T with m in 1..32, bf16
// operands (uint16_t bits, row-major), fp32 accumulation (mma.sync m16n8k16), fp32 or bf16 output (row-major
// [m, n]). For the decode projections of 2..32 rows (QKV, O, router at batch 2..32) that cuBLAS runs at about half
// the copy bandwidth or less (the acee781 ablation: QKV 9.6 us a layer at batch 16 against a 4.9 us stream, O 9.8
// against 3.9). CPU reference: src/gpu/reference/skinny_gemm_reference.hpp.
//
// Batch invariant: each output element is one dot product that the tensor core computes on its own, over K
// slices chosen from n and k only, summed in slice order; so row i of out is bitwise the same for every m (but
// not equal to the FMA skinny kernel's: another summation order). Capture-safe: no allocation, no
// synchronization; the grid depends on n, k, m and the device. A programmatic dependent launch (x is read after
// the wait through load_produced: dependent_launch.cuh).
// Returns cudaErrorInvalidValue for m outside 1..32, n < 0, k <= 0 or k % 8 != 0, x or w not 16-byte aligned, out
// not aligned to its element, or not exactly one of out_f32 / out_bf16 non-null. n == 0: no launch.
#include <cstdint>

#include <cuda_runtime.h>

namespace fulcrum::gpu {

constexpr int kDenseMmaMaxRows = 32;

cudaError_t launch_dense_mma_gemm(const uint16_t* x, const uint16_t* w, int m, int n, int k, float* out_f32,
                                  uint16_t* out_bf16, cudaStream_t stream);

// Whether DenseGemm takes it for bf16 steps of 2..32 rows that the FMA skinny kernel does not take
// (FULCRUM_DENSE_MMA=0: cuBLAS, for measurement; read once).
bool dense_mma_enabled();

}  // namespace fulcrum::gpu
