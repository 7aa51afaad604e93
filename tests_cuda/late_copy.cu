// launch_late_copy (late_copy.hpp).
#include "late_copy.hpp"

#include "gpu/kernels/dependent_launch.cuh"

namespace fulcrum::test {
namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void late_copy_kernel(const uint4* src, uint4* dst, int64_t chunks, uint32_t delay_ns) {
  gpu::wait_then_release();  // the kernel before (if any); then the next one may be scheduled
  const uint64_t until = global_ns() + delay_ns;
  while (global_ns() < until) __nanosleep(500);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < chunks; i += stride) dst[i] = src[i];
}

}  // namespace

cudaError_t launch_late_copy(const void* src, void* dst, size_t bytes, uint32_t delay_ns, cudaStream_t stream) {
  if (bytes == 0 || bytes % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(dst) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  return gpu::launch_dependent(late_copy_kernel, dim3(8), dim3(256), 0, stream, static_cast<const uint4*>(src),
                               static_cast<uint4*>(dst), static_cast<int64_t>(bytes / 16), delay_ns);
}

}  // namespace fulcrum::test
