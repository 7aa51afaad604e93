// Skinny GEMM (skinny_gemm.hpp). Work split, all from n and k (never m, so results are batch invariant):
//   - a warp owns a group of kRowsPerWarp = 4 consecutive W rows and one K slice of them;
//   - k_split (1, 2 or 4) warps of a block share a row group, each with a contiguous K slice; a block of 4
//     warps holds 4 / k_split row groups. k_split grows while the grid has fewer than kTargetWarps warps and each
//     slice keeps at least kMinSliceChunks 16-byte chunks, so small-N shapes (the router) still fill the GPU;
//   - lane l of a warp takes chunks c = begin + l, begin + l + 32, ... of its slice (8 bf16 each), two chunks per
//     row per loop trip (8 independent 16-byte W loads in flight per lane), and accumulates acc[r][i] with fp32
//     FMAs in K order; x chunks come through the read-only cache, W bypasses L1 so it does not evict x;
//   - lanes are combined by an xor butterfly, slices by a shared-memory sum in slice order.
#include <cuda_bf16.h>

#include "gpu/kernels/skinny_gemm.hpp"

namespace fulcrum::gpu {
namespace {

constexpr int kRowsPerWarp = 4;
constexpr int kWarpsPerBlock = 4;  // small blocks: at 160 registers (M = 8) 12 warps fit per SM, not 8
constexpr int kThreads = kWarpsPerBlock * 32;
constexpr int kMaxKSplit = kWarpsPerBlock;
constexpr int64_t kTargetWarps = 4096;  // ~2 waves of 132 SMs x 12..16 resident warps
constexpr int kMinSliceChunks = 64;     // 2 chunks per lane: one full loop trip
constexpr int kChunksPerTrip = 2;

// A 16-byte load of W, read once: through the non-coherent path without allocating in L1.
__device__ __forceinline__ uint4 load_w(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// bf16 value 2j of a 16-byte chunk is the low half of word j (little endian), value 2j + 1 the high half.
__device__ __forceinline__ float lo_bf16(uint32_t word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float hi_bf16(uint32_t word) { return __uint_as_float(word & 0xffff0000u); }
__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// acc[r][i] += w[r] . x[i] over one chunk of 8 values, in value order (explicit FMAs: the same arithmetic for
// every M).
template <int M>
__device__ __forceinline__ void fma_chunk(float (&acc)[kRowsPerWarp][M], const uint4 (&w)[kRowsPerWarp],
                                          const uint4 (&x)[M]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const uint32_t xw = word_of(x[i], j);
        const float xv = half == 0 ? lo_bf16(xw) : hi_bf16(xw);
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          const uint32_t ww = word_of(w[r], j);
          const float wv = half == 0 ? lo_bf16(ww) : hi_bf16(ww);
          acc[r][i] = __fmaf_rn(wv, xv, acc[r][i]);
        }
      }
    }
  }
}

template <bool kBf16Out>
__device__ __forceinline__ void store_out(void* out, int64_t idx, float v) {
  if constexpr (kBf16Out) {
    static_cast<uint16_t*>(out)[idx] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    static_cast<float*>(out)[idx] = v;
  }
}

// Grid: ceil(row_groups / (4 / k_split)) blocks of 128 threads. x [M, k], w [n, k], out [M, n].
template <int M, bool kBf16Out>
__global__ void __launch_bounds__(kThreads) skinny_gemm_kernel(const uint16_t* __restrict__ x,
                                                               const uint16_t* __restrict__ w, int n, int k,
                                                               int k_split, void* __restrict__ out) {
  __shared__ float partial[kWarpsPerBlock][kRowsPerWarp * M];  // [warp][r * M + i], used when k_split > 1
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int groups_per_block = kWarpsPerBlock / k_split;
  const int64_t first_row = (static_cast<int64_t>(blockIdx.x) * groups_per_block + warp / k_split) * kRowsPerWarp;
  const int slice = warp % k_split;
  const int64_t chunks = k / 8;  // per row
  const int64_t begin = chunks * slice / k_split, end = chunks * (slice + 1) / k_split;

  // Rows past n (the last group) read row n - 1 and store nothing; every warp still reaches __syncthreads.
  const uint4* w_rows[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t row = first_row + r < n ? first_row + r : n - 1;
    w_rows[r] = reinterpret_cast<const uint4*>(w) + row * chunks;
  }
  const uint4* x_chunks = reinterpret_cast<const uint4*>(x);  // row i at i * chunks

  float acc[kRowsPerWarp][M];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.0f;
  }

  int64_t c = begin + lane;
  for (; c + 32 * (kChunksPerTrip - 1) < end; c += 32 * kChunksPerTrip) {
    uint4 wv[kChunksPerTrip][kRowsPerWarp];
#pragma unroll
    for (int t = 0; t < kChunksPerTrip; ++t) {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) wv[t][r] = load_w(w_rows[r] + c + 32 * t);
    }
#pragma unroll
    for (int t = 0; t < kChunksPerTrip; ++t) {
      uint4 xv[M];
#pragma unroll
      for (int i = 0; i < M; ++i) xv[i] = __ldg(x_chunks + i * chunks + c + 32 * t);
      fma_chunk<M>(acc, wv[t], xv);
    }
  }
  for (; c < end; c += 32) {  // the slice's last chunk of this lane when its count is odd
    uint4 wv[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) wv[r] = load_w(w_rows[r] + c);
    uint4 xv[M];
#pragma unroll
    for (int i = 0; i < M; ++i) xv[i] = __ldg(x_chunks + i * chunks + c);
    fma_chunk<M>(acc, wv, xv);
  }

  // Butterfly: a + b == b + a, so every lane ends with the same sums.
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        acc[r][i] = __fadd_rn(acc[r][i], __shfl_xor_sync(0xffffffffu, acc[r][i], offset));
      }
    }
  }

  if (k_split == 1) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
      for (int i = 0; i < M; ++i) {
        if (lane == r * M + i && first_row + r < n) store_out<kBf16Out>(out, i * static_cast<int64_t>(n) + first_row + r, acc[r][i]);
      }
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      if (lane == r * M + i) partial[warp][r * M + i] = acc[r][i];
    }
  }
  __syncthreads();
  const int t = static_cast<int>(threadIdx.x);
  if (t < groups_per_block * kRowsPerWarp * M) {
    const int group = t / (kRowsPerWarp * M), j = t % (kRowsPerWarp * M);
    const int r = j / M, i = j % M;
    const int64_t row = (static_cast<int64_t>(blockIdx.x) * groups_per_block + group) * kRowsPerWarp + r;
    float sum = partial[group * k_split][j];
    for (int s = 1; s < k_split; ++s) sum = __fadd_rn(sum, partial[group * k_split + s][j]);
    if (row < n) store_out<kBf16Out>(out, i * static_cast<int64_t>(n) + row, sum);
  }
}

int choose_k_split(int64_t row_groups, int64_t chunks) {
  int k_split = 1;
  while (k_split < kMaxKSplit && row_groups * k_split < kTargetWarps && chunks / (2 * k_split) >= kMinSliceChunks) {
    k_split *= 2;
  }
  return k_split;
}

template <int M>
cudaError_t launch_rows(const uint16_t* x, const uint16_t* w, int n, int k, void* out, bool bf16_out,
                        cudaStream_t stream) {
  const int64_t row_groups = (static_cast<int64_t>(n) + kRowsPerWarp - 1) / kRowsPerWarp;
  const int k_split = choose_k_split(row_groups, k / 8);
  const int groups_per_block = kWarpsPerBlock / k_split;
  const int64_t blocks = (row_groups + groups_per_block - 1) / groups_per_block;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  if (bf16_out) {
    skinny_gemm_kernel<M, true><<<grid, kThreads, 0, stream>>>(x, w, n, k, k_split, out);
  } else {
    skinny_gemm_kernel<M, false><<<grid, kThreads, 0, stream>>>(x, w, n, k, k_split, out);
  }
  return cudaGetLastError();
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

cudaError_t launch_skinny_gemm(const uint16_t* x, const uint16_t* w, int m, int n, int k, float* out_f32,
                               uint16_t* out_bf16, cudaStream_t stream) {
  if (m < 1 || m > kSkinnyGemmMaxRows || n < 0 || k <= 0 || k % 8 != 0) return cudaErrorInvalidValue;
  if ((out_f32 == nullptr) == (out_bf16 == nullptr)) return cudaErrorInvalidValue;
  if (x == nullptr || w == nullptr || !aligned(x, 16) || !aligned(w, 16)) return cudaErrorInvalidValue;
  if (!aligned(out_f32, alignof(float)) || !aligned(out_bf16, alignof(uint16_t))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  void* out = out_f32 != nullptr ? static_cast<void*>(out_f32) : static_cast<void*>(out_bf16);
  const bool bf16_out = out_bf16 != nullptr;
  switch (m) {
    case 1: return launch_rows<1>(x, w, n, k, out, bf16_out, stream);
    case 2: return launch_rows<2>(x, w, n, k, out, bf16_out, stream);
    case 3: return launch_rows<3>(x, w, n, k, out, bf16_out, stream);
    case 4: return launch_rows<4>(x, w, n, k, out, bf16_out, stream);
    case 5: return launch_rows<5>(x, w, n, k, out, bf16_out, stream);
    case 6: return launch_rows<6>(x, w, n, k, out, bf16_out, stream);
    case 7: return launch_rows<7>(x, w, n, k, out, bf16_out, stream);
    default: return launch_rows<8>(x, w, n, k, out, bf16_out, stream);
  }
}

}  // namespace fulcrum::gpu
