#pragma once
// A warp copies one row of n 16-byte words, kCopyAhead words a lane loaded before any is stored: one load and
// store at a time left a warp one HBM round trip per 512 bytes (the compiler may not move a load above a store
// that could alias it), and the 16384-token permutation at 3.1 TB/s. Used by the MoE permutations
// (gpu/moe/moe_kernels.cu) and the grouped GEMM setup's row gather (gpu/cutlass/grouped_gemm_bf16.cuh).
#include <cstdint>

namespace fulcrum::gpu {

constexpr int kCopyAhead = 8;

__device__ __forceinline__ void copy_row16(const uint4* src, uint4* dst, int n, int lane) {
  for (int c0 = lane; c0 < n; c0 += 32 * kCopyAhead) {
    uint4 raw[kCopyAhead];
#pragma unroll
    for (int u = 0; u < kCopyAhead; ++u) {
      if (c0 + 32 * u < n) raw[u] = src[c0 + 32 * u];
    }
#pragma unroll
    for (int u = 0; u < kCopyAhead; ++u) {
      if (c0 + 32 * u < n) dst[c0 + 32 * u] = raw[u];
    }
  }
}

}  // namespace fulcrum::gpu
