#pragma once
// Small helpers shared by the CUDA backend's kernels: grid sizing for grid-stride loops and block-wide
// reductions.
#include <cstdint>

#include <cuda_runtime.h>

namespace fulcrum::cuda {

constexpr int kThreadsPerBlock = 256;

// Blocks for a grid-stride loop over n elements (at least 1; capped, the loop covers the rest).
inline unsigned int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > 65535 * 8 ? 65535 * 8 : blocks));
}

template <typename T>
__device__ T warp_sum(T v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__device__ T warp_max(T v) {
  for (int offset = 16; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 values; the call synchronizes the block.
template <typename T>
__device__ T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = lane < num_warps ? scratch[lane] : T(0);
  return warp_sum(total);
}

// Max over the block, same contract as block_sum.
template <typename T>
__device__ T block_max(T v, T* scratch, T lowest) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = lane < num_warps ? scratch[lane] : lowest;
  return warp_max(total);
}

}  // namespace fulcrum::cuda
