// Dynamic 1x128 e4m3 quantization of activations for the FP8 grouped GEMM (fp8_quant.hpp). One warp per row
// (grid-stride over the rows [offsets[0], offsets[num_groups])), its two halves on two 128-column blocks at a
// time: each lane holds 8 columns (one 16-byte load of bf16, two for SwiGLU's gate and up), the half-warp
// reduces the block's amax with 4 shuffles, every lane writes its 8 e4m3 bytes and lane 0 of the half the
// scale. The row's group, which fixes where its scales go, comes from a binary search over the offsets.
// Arithmetic as the CPU reference (gpu/reference/fp8_reference.cpp) does it, written with _rn intrinsics so
// that nothing is contracted: 448 / amax and amax / 448 are IEEE divisions, x * (448 / amax) one rounding,
// then __nv_cvt_float_to_fp8 (round to nearest even, saturating to +-448).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/fp8_block_quant.cuh"
#include "gpu/kernels/fp8_quant.hpp"

namespace fulcrum::gpu {
namespace {

using fp8_block::kBlockCols;
using fp8_block::kColsPerLane;
using fp8_block::kLanesPerBlock;
using fp8_block::unpack8;
constexpr int kWarpsPerCtaBlock = 8;      // rows in flight per thread block

// bf16(silu(gate) * up) as the bf16 path computes it (step_ops.cu's silu_times: expf, not __expf).
__device__ __forceinline__ float swiglu_bf16(float gate, float up) {
  const float v = __fmul_rn(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate))), up);
  return __bfloat162float(__float2bfloat16_rn(v));
}

// The group g with offsets[g] <= row < offsets[g + 1], for offsets[0] <= row < offsets[num_groups] (empty
// groups have equal offsets and are skipped by the search).
__device__ __forceinline__ int group_of(const int32_t* offsets, int num_groups, int64_t row) {
  int lo = 0, hi = num_groups;  // offsets[lo] <= row < offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <bool kSwiGlu>
__global__ void quantize_fp8_kernel(const uint16_t* src, int cols, const int32_t* offsets, int num_groups, uint8_t* q,
                                    float* scales) {
  wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  const int lane = threadIdx.x % 32;
  const int half = lane / kLanesPerBlock;  // which of the warp's two blocks
  const int sub = lane % kLanesPerBlock;   // its 8 columns within the block
  const unsigned int half_mask = fp8_block::half_mask(lane);
  const int k_blocks = cols / kBlockCols;
  const int64_t begin = offsets[0], end = offsets[num_groups];
  const int64_t warp = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32;
  const int64_t num_warps = int64_t{gridDim.x} * blockDim.x / 32;
  for (int64_t r = begin + warp; r < end; r += num_warps) {  // warp-uniform
    const int g = group_of(offsets, num_groups, r);
    const int64_t first = offsets[g];
    const int64_t rows_in_group = offsets[g + 1] - first;
    float* row_scales = scales + first * k_blocks + (r - first);  // sa(r, kb) at row_scales[kb * rows_in_group]
    for (int kb = half; kb < k_blocks; kb += 2) {  // uniform within each half-warp
      const int c0 = kb * kBlockCols + sub * kColsPerLane;
      float v[kColsPerLane];
      if constexpr (kSwiGlu) {
        const uint16_t* h_row = src + r * 2 * cols;  // [2 cols]: gate | up
        float gate[kColsPerLane], up[kColsPerLane];
        unpack8(*reinterpret_cast<const uint4*>(h_row + c0), gate);
        unpack8(*reinterpret_cast<const uint4*>(h_row + cols + c0), up);
#pragma unroll
        for (int i = 0; i < kColsPerLane; ++i) v[i] = swiglu_bf16(gate[i], up[i]);
      } else {
        unpack8(*reinterpret_cast<const uint4*>(src + r * cols + c0), v);
      }
      const fp8_block::Quantized8 out = fp8_block::quantize8(v, half_mask);
      *reinterpret_cast<uint2*>(q + r * cols + c0) = out.codes;
      if (sub == 0) row_scales[int64_t{kb} * rows_in_group] = out.scale;
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <bool kSwiGlu>
cudaError_t launch_quantize(const uint16_t* src, int cols, const int32_t* offsets, int num_groups, int64_t max_rows,
                            uint8_t* q, float* scales, cudaStream_t stream) {
  if (cols <= 0 || cols % kBlockCols != 0 || src == nullptr || offsets == nullptr || q == nullptr ||
      scales == nullptr || !aligned16(src) || !aligned16(q) || num_groups < 1 || max_rows < 0) {
    return cudaErrorInvalidValue;
  }
  if (max_rows == 0) return cudaSuccess;
  const int64_t blocks = (max_rows + kWarpsPerCtaBlock - 1) / kWarpsPerCtaBlock;
  const dim3 grid(static_cast<unsigned int>(blocks < 65535 * 8 ? blocks : 65535 * 8));  // grid-stride covers the rest
  return launch_dependent(quantize_fp8_kernel<kSwiGlu>, grid, dim3(32 * kWarpsPerCtaBlock), 0, stream, src, cols,
                          offsets, num_groups, q, scales);
}

}  // namespace

cudaError_t launch_quantize_rows_fp8(const uint16_t* x, int cols, const int32_t* offsets, int num_groups,
                                     int64_t max_rows, uint8_t* q, float* scales, cudaStream_t stream) {
  return launch_quantize<false>(x, cols, offsets, num_groups, max_rows, q, scales, stream);
}

cudaError_t launch_swiglu_quantize_fp8(const uint16_t* h, int cols, const int32_t* offsets, int num_groups,
                                       int64_t max_rows, uint8_t* q, float* scales, cudaStream_t stream) {
  return launch_quantize<true>(h, cols, offsets, num_groups, max_rows, q, scales, stream);
}

}  // namespace fulcrum::gpu
