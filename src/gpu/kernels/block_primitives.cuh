#pragma once
// Block-wide building blocks of the sampler (sampler.cu), for a block of kThreads threads (a multiple of 32).
// Every thread of the block must call each of them (they synchronize), and every thread gets the same result:
// the order of each sum is fixed by kThreads alone, so results do not vary from run to run.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "gpu/kernels/dependent_launch.cuh"

namespace fulcrum::gpu::block {

// f(i, row[i]) for every i in [0, n), each element by one thread; 16-byte loads, kUnroll of them in flight per
// thread, when the row is 16-byte aligned (scalar loads otherwise). Thread t's elements come in increasing i. The row is
// an earlier kernel's output (the LM head's logits): loaded as dependent_launch.cuh's load_produced says.
template <int kThreads, int kUnroll, typename F>
__device__ __forceinline__ void for_each_float(const float* row, int n, F&& f) {
  int tail = 0;
  if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    const int n4 = n / 4;
    for (int q = threadIdx.x; q < n4; q += kUnroll * kThreads) {
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (q + u * kThreads < n4) v[u] = load_produced(row4 + q + u * kThreads);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = 4 * (q + u * kThreads);
        if (q + u * kThreads < n4) f(i, v[u].x), f(i + 1, v[u].y), f(i + 2, v[u].z), f(i + 3, v[u].w);
      }
    }
    tail = 4 * n4;
  }
  for (int i = tail + threadIdx.x; i < n; i += kThreads) f(i, load_produced(row + i));
}

// Exclusive prefix sum of v over the threads in thread order; *total = the sum of all. warp_sums: shared
// [kThreads / 32].
template <int kThreads>
__device__ double exclusive_scan(double* warp_sums, double v, double* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const double other = __shfl_up_sync(~0u, incl, o);
    if (lane >= o) incl += other;
  }
  double excl = __shfl_up_sync(~0u, incl, 1);
  if (lane == 0) excl = 0.0;
  __syncthreads();  // warp_sums may still be read by the previous scan
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  double before = 0.0, all = 0.0;
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w == warp) before = all;
    all += warp_sums[w];
  }
  *total = all;
  return before + excl;
}

// Min of v over the block; `slot` is one shared int.
template <int kThreads>
__device__ int min_of(int* slot, int v) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(~0u, v, o));
  __syncthreads();  // the previous result may still be read
  if (threadIdx.x == 0) *slot = INT_MAX;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) atomicMin(slot, v);
  __syncthreads();
  return *slot;
}
template <int kThreads>
__device__ int max_of(int* slot, int v) {  // v > INT_MIN
  return -min_of<kThreads>(slot, -v);
}

// Sorts keys[0, n) ascending in shared memory (bitonic, padded with ~0 to the next power of two, which keys must
// have room for).
template <int kThreads>
__device__ void bitonic_sort(uint64_t* keys, int n) {
  int size = 1;
  while (size < n) size <<= 1;
  for (int i = n + threadIdx.x; i < size; i += kThreads) keys[i] = ~0ull;
  __syncthreads();
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < size; i += kThreads) {
        const int partner = i ^ j;
        if (partner <= i) continue;
        const uint64_t a = keys[i], b = keys[partner];
        if ((a > b) == ((i & k) == 0)) keys[i] = b, keys[partner] = a;
      }
      __syncthreads();
    }
  }
}

}  // namespace fulcrum::gpu::block
