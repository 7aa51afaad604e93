// Dense tensor-core GEMM for a few rows (dense_mma_gemm.hpp). Work split: a warp owns 16 consecutive W rows and one
// K slice (skinny_mma::choose_k_split, from n and k only); k_split warps of a 4-warp block share a
// row tile, so a block holds 4 / k_split tiles of 16 rows; the x rows go in NT tiles of 8 (NT = ceil(m / 8), rows
// past m read row m - 1 and store nothing). A persistent grid over the row tiles, sized by the blocks that fit per
// SM.
#include "gpu/kernels/dense_mma_gemm.hpp"

#include <algorithm>

#include "gpu/env_switch.hpp"
#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/skinny_mma_core.cuh"
#include "gpu/kernels/skinny_plan.hpp"

namespace fulcrum::gpu {
namespace {

constexpr int kThreads = skinny_mma::kThreads;
constexpr int kWarps = skinny_mma::kWarpsPerBlock;

template <int NT, bool kBf16Out>
__global__ void __launch_bounds__(kThreads) dense_mma_kernel(const uint16_t* x, const uint16_t* __restrict__ w,
                                                             int m, int n, int k, int k_split, int64_t tiles,
                                                             void* __restrict__ out) {
  wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  __shared__ float partial[kWarps][NT * 4][32];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  const int groups_per_block = kWarps / k_split, slice = warp % k_split;
  const int64_t blocks = (k + skinny_mma::kBlockValues - 1) / skinny_mma::kBlockValues;
  const int64_t block_begin = blocks * slice / k_split, block_end = blocks * (slice + 1) / k_split;
  const uint16_t* x_rows[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) x_rows[j] = x + static_cast<int64_t>(min(8 * j + g, m - 1)) * k;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t first_row = (tile * groups_per_block + warp / k_split) * skinny_mma::kWarpRows;
    // Rows past n read row n - 1 and store nothing.
    const int64_t lo = min(first_row + g, static_cast<int64_t>(n - 1));
    const int64_t hi = min(first_row + 8 + g, static_cast<int64_t>(n - 1));
    float acc[NT][4];
    skinny_mma::warp_mma<NT>(w + lo * k, w + hi * k, x_rows, block_begin, block_end, k, t, acc);
    skinny_mma::sum_slices<NT>(acc, warp, lane, k_split, partial);
    if (slice != 0) continue;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 8 * j + 2 * t + (e & 1);
        const int64_t row = first_row + g + (e >= 2 ? 8 : 0);
        if (i < m && row < n) {
          const int64_t idx = i * static_cast<int64_t>(n) + row;
          if constexpr (kBf16Out) {
            static_cast<uint16_t*>(out)[idx] = skinny::to_bf16(acc[j][e]);
          } else {
            static_cast<float*>(out)[idx] = acc[j][e];
          }
        }
      }
    }
  }
}

// Blocks of a kernel resident per SM (registers bound them), read once per kernel.
template <int NT, bool kBf16Out>
int resident_blocks_per_sm() {
  static const int blocks = [] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, dense_mma_kernel<NT, kBf16Out>, kThreads, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      return 1;
    }
    return std::max(1, b);
  }();
  return blocks;
}

template <int NT, bool kBf16Out>
cudaError_t launch_tiles(const uint16_t* x, const uint16_t* w, int m, int n, int k, void* out, cudaStream_t stream) {
  const int64_t warp_tiles = (static_cast<int64_t>(n) + skinny_mma::kWarpRows - 1) / skinny_mma::kWarpRows;
  const int k_split = skinny_mma::choose_k_split(warp_tiles, k);
  const int groups_per_block = kWarps / k_split;
  const int64_t tiles = (warp_tiles + groups_per_block - 1) / groups_per_block;
  const int64_t blocks =
      std::min<int64_t>(tiles, int64_t{skinny::device_sms()} * resident_blocks_per_sm<NT, kBf16Out>());
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  return launch_dependent(dense_mma_kernel<NT, kBf16Out>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
                          stream, x, w, m, n, k, k_split, tiles, out);
}

template <int NT>
cudaError_t launch_rows(const uint16_t* x, const uint16_t* w, int m, int n, int k, void* out, bool bf16_out,
                        cudaStream_t stream) {
  return bf16_out ? launch_tiles<NT, true>(x, w, m, n, k, out, stream)
                  : launch_tiles<NT, false>(x, w, m, n, k, out, stream);
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

bool dense_mma_enabled() {
  static const bool enabled = env_switch_on("FULCRUM_DENSE_MMA");
  return enabled;
}

cudaError_t launch_dense_mma_gemm(const uint16_t* x, const uint16_t* w, int m, int n, int k, float* out_f32,
                                  uint16_t* out_bf16, cudaStream_t stream) {
  if (m < 1 || m > kDenseMmaMaxRows || n < 0 || k <= 0 || k % 8 != 0) return cudaErrorInvalidValue;
  if ((out_f32 == nullptr) == (out_bf16 == nullptr)) return cudaErrorInvalidValue;
  if (x == nullptr || w == nullptr || !aligned(x, 16) || !aligned(w, 16)) return cudaErrorInvalidValue;
  if (!aligned(out_f32, alignof(float)) || !aligned(out_bf16, alignof(uint16_t))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  void* out = out_f32 != nullptr ? static_cast<void*>(out_f32) : static_cast<void*>(out_bf16);
  const bool bf16_out = out_bf16 != nullptr;
  if (m <= 8) return launch_rows<1>(x, w, m, n, k, out, bf16_out, stream);
  if (m <= 16) return launch_rows<2>(x, w, m, n, k, out, bf16_out, stream);
  if (m <= 24) return launch_rows<3>(x, w, m, n, k, out, bf16_out, stream);
  return launch_rows<4>(x, w, m, n, k, out, bf16_out, stream);
}

}  // namespace fulcrum::gpu
