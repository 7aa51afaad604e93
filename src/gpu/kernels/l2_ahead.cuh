#pragma once
// Device side of L2Ahead (l2_ahead.hpp): block `part` of `parts` asks L2 for its share of the span, in bulk
// prefetches of kL2AheadChunk bytes from its first warp. No completion is awaited and nothing is written.
#include <cstdint>

#include "gpu/kernels/l2_ahead.hpp"

namespace fulcrum::gpu {

constexpr int64_t kL2AheadChunk = 16384;

__device__ __forceinline__ void ask_l2_ahead(const L2Ahead& a, int64_t part, int64_t parts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (a.bytes < 16 || threadIdx.x >= 32 || (reinterpret_cast<uintptr_t>(a.data) & 15) != 0) return;
  const int64_t chunks = (a.bytes + kL2AheadChunk - 1) / kL2AheadChunk;
  const int64_t begin = chunks * part / parts, end = chunks * (part + 1) / parts;
  const char* base = static_cast<const char*>(a.data);
  for (int64_t c = begin + threadIdx.x; c < end; c += 32) {
    const int64_t offset = c * kL2AheadChunk;
    const int64_t left = a.bytes - offset;
    const auto size = static_cast<uint32_t>((left < kL2AheadChunk ? left : kL2AheadChunk) & ~int64_t{15});
    if (size > 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + offset), "r"(size) : "memory");
  }
#endif
}

}  // namespace fulcrum::gpu
