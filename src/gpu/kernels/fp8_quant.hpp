#pragma once
// Dynamic 1x128 activation quantization to e4m3 for the FP8 grouped GEMM (gpu/cutlass/grouped_gemm_fp8.hpp),
// writing the activation scales in its grouped layout. Per (row r, 128-column block kb):
//   amax = max |x[r][c]| over the block;  scale = amax / 448;  q[r][c] = e4m3(x[r][c] * (448 / amax))
// (448 / amax one IEEE fp32 division, e4m3 round to nearest even, saturating; amax == 0: scale 0 and q 0).
// Group g = rows [offsets[g], offsets[g + 1]) (f its first row, m its rows) stores sa(r, kb) at
//   scales[f * Kb + kb * m + (r - f)],  Kb = cols / 128.
// Rows [offsets[0], offsets[num_groups]) are processed (read on the device); the grid covers max_rows rows
// (a host bound, fixed for a captured batch; one warp per row, grid-stride, so more rows are still right, only
// slower). scales must hold offsets[num_groups] * Kb floats (absolute rows, as the offsets). CPU reference: gpu::reference::quantize_rows_fp8 /
// swiglu_quantize_fp8 (src/gpu/reference/fp8_reference.hpp): q and scales bitwise equal for quantize_rows_fp8.
// Capture-safe: no allocation, no synchronization. cudaErrorInvalidValue for cols % 128 != 0, null pointers,
// misaligned (16-byte) x / h / q rows, num_groups < 1, max_rows < 0.
#include <cstdint>

#include <cuda_runtime.h>

namespace fulcrum::gpu {

// x [rows, cols] bf16 row-major (absolute row indices, as the offsets) -> q [rows, cols] e4m3, scales.
cudaError_t launch_quantize_rows_fp8(const uint16_t* x, int cols, const int32_t* offsets, int num_groups,
                                     int64_t max_rows, uint8_t* q, float* scales, cudaStream_t stream);

// SwiGLU then quantization: h [rows, 2 * cols] bf16 (gate columns [0, cols), up columns [cols, 2 cols)) ->
// a = bf16(silu(g) * u) (g, u the bf16 values, silu(g) = g / (1 + exp(-g)), rounded to bf16 as the bf16 path
// stores its activation), then quantized as above into q [rows, cols] e4m3 and scales.
cudaError_t launch_swiglu_quantize_fp8(const uint16_t* h, int cols, const int32_t* offsets, int num_groups,
                                       int64_t max_rows, uint8_t* q, float* scales, cudaStream_t stream);

}  // namespace fulcrum::gpu
