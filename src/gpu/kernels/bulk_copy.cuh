#pragma once
// Hopper bulk copies global -> shared memory (cp.async.bulk, the TMA unit's non-tensor form) completing on an
// mbarrier: one instruction moves a whole contiguous tile, so a block has all of it in flight without holding a
// register per 16 bytes. Used where a kernel streams weights it reads once (the skinny GEMMs' bulk kernels).
// sm_90 only: below it each call traps (the build targets sm_90a; a kernel built for an older GPU must not read
// shared memory that no copy filled).
#include <cstdint>

namespace fulcrum::gpu::bulk {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread: a barrier expecting one arrival (with its bytes) per phase, made visible to the async proxy.
__device__ __forceinline__ void barrier_init(uint64_t* barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(barrier)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// One thread: arm the barrier's phase with the bytes of the copies that follow (one arrival).
__device__ __forceinline__ void expect_bytes(uint64_t* barrier, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// One thread: copy `bytes` (a multiple of 16; src, dst 16-byte aligned), counted against the armed phase.
__device__ __forceinline__ void copy_bytes(void* dst, const void* src, uint32_t bytes, uint64_t* barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_address(dst)),
               "l"(src), "r"(bytes), "r"(shared_address(barrier))
               : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// One thread: one copy as a whole phase.
__device__ __forceinline__ void copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* barrier) {
  expect_bytes(barrier, bytes);
  copy_bytes(dst, src, bytes, barrier);
}

// Every reader: until the barrier's phase of this parity has completed (its bytes have landed).
__device__ __forceinline__ void wait_phase(uint64_t* barrier, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra WAIT_%=;\n\t}" ::"r"(shared_address(barrier)),
      "r"(parity)
      : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Before a bulk copy overwrites shared memory that threads read with ordinary loads (after the barrier that
// ends those reads): orders the generic-proxy reads before the async-proxy writes.
__device__ __forceinline__ void fence_before_async_write() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

}  // namespace fulcrum::gpu::bulk
