#pragma once
// A producer for the dependent-launch tests (pdl_late_producer_test.cpp): copies `bytes` from src to dst on the
// device, but only `delay_ns` after it starts, and lets the next kernel in the stream be scheduled at once (it
// is launched with launch_dependent and releases right after its own wait). A kernel launched after it with
// launch_dependent therefore runs while dst still holds what it held before, until its griddepcontrol.wait
// returns: any read of dst that was scheduled ahead of that wait sees the old contents. CPU reference: memcpy.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace fulcrum::test {

// cudaErrorInvalidValue unless bytes is a positive multiple of 16 and src / dst are 16-byte aligned.
cudaError_t launch_late_copy(const void* src, void* dst, size_t bytes, uint32_t delay_ns, cudaStream_t stream);

}  // namespace fulcrum::test
