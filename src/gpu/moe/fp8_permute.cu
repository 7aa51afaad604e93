// The permutation of an FP8 layer fused with the 1x128 e4m3 quantization of its rows (launch_permute_rows_fp8,
// moe_kernels.hpp). One warp per token: lanes j < k claim a row of entry j's slot (atomics on the cursor, as
// permute_rows_kernel), write entry_row and keep the row, its slot's first row and size in the warp's shared
// slots; then the warp reads the token's bf16 row once, eight 128-column blocks at a time (a half-warp on every
// other block, 8 columns per lane), and stores each block's 8 e4m3 bytes per lane and its scale to all k rows.
// The arithmetic is fp8_quant.cu's (the contract in gpu/kernels/fp8_quant.hpp), operation for operation, so
// the bits equal launch_quantize_rows_fp8 on the bf16 permuted rows: amax by fmaxf over the block's fp32
// copies of bf16 values, 448 / amax and amax / 448 IEEE divisions (_rn: nothing contracted), x * (448 / amax)
// one rounding, __nv_cvt_float_to_fp8 (round to nearest even, saturating); amax 0: scale 0 and codes 0.
#include <cuda_fp8.h>

#include "gpu/kernels/fp8_block_quant.cuh"
#include "gpu/moe/moe_kernels.hpp"

namespace fulcrum::cuda::moe {
namespace {

using gpu::fp8_block::kBlockCols;
using gpu::fp8_block::kColsPerLane;
using gpu::fp8_block::kLanesPerBlock;
using gpu::fp8_block::unpack8;
constexpr int kTokensPerCta = 8;  // one warp per token
constexpr int kLoadsAhead = 4;     // 16-byte loads in flight per lane

__global__ void __launch_bounds__(32 * kTokensPerCta)
    permute_rows_fp8_kernel(const uint16_t* x, int64_t num_tokens, int top_k, int hidden_size, const int32_t* slots,
                            const int32_t* offsets, int32_t* cursor, int32_t* entry_row, uint8_t* q, float* scales) {
  // Per warp, per entry j of its token: the destination row, where its scale of block 0 goes
  // (f * Kb + (row - f)), and its slot's rows m (the scales' stride between blocks).
  __shared__ int32_t s_row[kTokensPerCta][kMaxTopK];
  __shared__ int64_t s_scale0[kTokensPerCta][kMaxTopK];
  __shared__ int32_t s_slot_rows[kTokensPerCta][kMaxTopK];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int half = lane / kLanesPerBlock;  // which of the warp's two blocks
  const int sub = lane % kLanesPerBlock;   // its 8 columns within the block
  const unsigned int half_mask = gpu::fp8_block::half_mask(lane);
  const int k_blocks = hidden_size / kBlockCols;
  const int64_t num_warps = int64_t{gridDim.x} * kTokensPerCta;
  for (int64_t t = int64_t{blockIdx.x} * kTokensPerCta + warp; t < num_tokens; t += num_warps) {  // warp-uniform
    if (lane < top_k) {
      const int64_t entry = t * top_k + lane;
      const int32_t slot = slots[entry];
      const int32_t row = atomicAdd(&cursor[slot], 1);
      const int32_t first = offsets[slot];
      entry_row[entry] = row;
      s_row[warp][lane] = row;
      s_scale0[warp][lane] = int64_t{first} * k_blocks + (row - first);
      s_slot_rows[warp][lane] = offsets[slot + 1] - first;
    }
    __syncwarp();
    const uint16_t* x_row = x + t * hidden_size;  // [H]
    // kLoadsAhead of the half-warp's blocks loaded before any is stored: the k stores of each block would
    // otherwise hold its next load back (the compiler may not move a load above a store that could alias it).
    for (int kb0 = half; kb0 < k_blocks; kb0 += 2 * kLoadsAhead) {  // uniform within each half-warp
      uint4 raw[kLoadsAhead];
#pragma unroll
      for (int u = 0; u < kLoadsAhead; ++u) {
        const int kb = kb0 + 2 * u;
        if (kb < k_blocks) raw[u] = *reinterpret_cast<const uint4*>(x_row + kb * kBlockCols + sub * kColsPerLane);
      }
#pragma unroll
      for (int u = 0; u < kLoadsAhead; ++u) {
        const int kb = kb0 + 2 * u;
        if (kb >= k_blocks) break;
        const int c0 = kb * kBlockCols + sub * kColsPerLane;
        float v[kColsPerLane];
        unpack8(raw[u], v);
        const gpu::fp8_block::Quantized8 out = gpu::fp8_block::quantize8(v, half_mask);
        for (int j = 0; j < top_k; ++j) {  // the block computed once, stored to each of the token's k rows
          *reinterpret_cast<uint2*>(q + int64_t{s_row[warp][j]} * hidden_size + c0) = out.codes;
          if (sub == 0) scales[s_scale0[warp][j] + int64_t{kb} * s_slot_rows[warp][j]] = out.scale;
        }
      }
    }
    __syncwarp();  // every lane done with this token's shared slots before the next token's lanes rewrite them
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t launch_permute_rows_fp8(const uint16_t* x, int64_t num_tokens, int top_k, int hidden_size,
                                    const int32_t* slots, const int32_t* offsets, int32_t* cursor, int32_t* entry_row,
                                    uint8_t* q, float* scales, cudaStream_t stream) {
  if (num_tokens < 0 || top_k < 1 || top_k > kMaxTopK || hidden_size <= 0 || hidden_size % kBlockCols != 0 ||
      x == nullptr || slots == nullptr || offsets == nullptr || cursor == nullptr || entry_row == nullptr ||
      q == nullptr || scales == nullptr || !aligned16(x) || !aligned16(q)) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) return cudaSuccess;
  const int64_t blocks = (num_tokens + kTokensPerCta - 1) / kTokensPerCta;
  const dim3 grid(static_cast<unsigned int>(blocks < 65535 * 16 ? blocks : 65535 * 16));  // grid-stride covers the rest
  permute_rows_fp8_kernel<<<grid, 32 * kTokensPerCta, 0, stream>>>(x, num_tokens, top_k, hidden_size, slots, offsets,
                                                                  cursor, entry_row, q, scales);
  return cudaGetLastError();
}

}  // namespace fulcrum::cuda::moe
