#pragma once
// The 1x128 e4m3 block quantization both FP8 activation kernels run (fp8_quant.cu, gpu/moe/fp8_permute.cu): a
// 128-column block is held by a half-warp, 8 columns per lane (one 16-byte load of bf16). The arithmetic is the
// contract of fp8_quant.hpp, written with _rn intrinsics so nothing is contracted: amax by fmaxf, 448 / amax and
// amax / 448 IEEE divisions, x * (448 / amax) one rounding, __nv_cvt_float_to_fp8 (round to nearest even,
// saturating to +-448); amax 0: codes 0 and scale 0. The CPU reference is gpu/reference/fp8_reference.cpp.
#include <cstdint>

#include <cuda_fp8.h>

namespace fulcrum::gpu::fp8_block {

constexpr int kBlockCols = 128;                            // one activation scale per 128 columns (the GEMM's k block)
constexpr int kColsPerLane = 8;                            // 16 bytes of bf16
constexpr int kLanesPerBlock = kBlockCols / kColsPerLane;  // 16: half a warp
constexpr float kE4m3Max = 448.0f;

// bf16 bits -> fp32 of one 16-byte load (8 values, little endian).
__device__ __forceinline__ void unpack8(const uint4 bits, float (&f)[kColsPerLane]) {
  const uint32_t w[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = __uint_as_float(w[k] << 16);  // value 2k is the low half of word k
    f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}

// The mask of the half-warp that holds `lane`'s block.
__device__ __forceinline__ unsigned int half_mask(int lane) {
  return lane / kLanesPerBlock == 0 ? 0x0000ffffu : 0xffff0000u;
}

struct Quantized8 {
  uint2 codes;  // this lane's 8 e4m3 bytes, byte i = column i
  float scale;  // the block's scale (the same on every lane of the half-warp)
};

// Every lane of the half-warp calls it with its 8 values; the block's amax is reduced over the half-warp.
__device__ __forceinline__ Quantized8 quantize8(const float (&v)[kColsPerLane], unsigned int mask) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kColsPerLane; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int offset = kLanesPerBlock / 2; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, offset));
  uint32_t packed[2] = {0u, 0u};
  if (amax > 0.0f) {
    const float inv = __fdiv_rn(kE4m3Max, amax);
#pragma unroll
    for (int i = 0; i < kColsPerLane; ++i) {
      const uint32_t code = __nv_cvt_float_to_fp8(__fmul_rn(v[i], inv), __NV_SATFINITE, __NV_E4M3);
      packed[i / 4] |= code << (8 * (i % 4));
    }
  }
  return {make_uint2(packed[0], packed[1]), amax > 0.0f ? __fdiv_rn(amax, kE4m3Max) : 0.0f};
}

}  // namespace fulcrum::gpu::fp8_block
