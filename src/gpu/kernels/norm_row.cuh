#pragma once
// One row's residual add + RMSNorm arithmetic, as the CPU reference (step_ops_reference.cpp) orders it: fp32 adds,
// the sum of squares in double, weight * (x * inv_rms) with _rn intrinsics (nvcc contracts nothing into an FMA).
// Shared by the add + RMSNorm kernels (step_ops.cu) and the post-attention norm fused with the router
// (moe/norm_router_route.cu), so the two give the same bits.
#include <cstdint>

#include <cuda_bf16.h>

namespace fulcrum::gpu::norm_row {

__device__ __forceinline__ float bf16_to_f32(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}
__device__ __forceinline__ uint16_t f32_to_bf16(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }

// Value 2k of 8 bf16 is the low half of word k (little endian).
__device__ __forceinline__ void unpack8(const uint4 bits, float (&f)[8]) {
  const uint32_t w[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = __uint_as_float(w[k] << 16);
    f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return static_cast<uint32_t>(f32_to_bf16(lo)) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
}
__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}

// 1 / sqrt(mean + eps) from a row's double sum of squares, as the reference's inv_rms.
__device__ __forceinline__ float inv_rms_of(double sum_sq, int dim, float eps) {
  const float variance = static_cast<float>(sum_sq / static_cast<double>(dim));
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(variance, eps)));
}
// weight * (x * inv_rms), the reference's product order.
__device__ __forceinline__ float norm_scale(float weight, float x, float inv_rms) {
  return __fmul_rn(weight, __fmul_rn(x, inv_rms));
}

}  // namespace fulcrum::gpu::norm_row
