#pragma once
// Programmatic dependent launch (Hopper): a kernel launched with launch_dependent may be scheduled while the kernel
// before it in the stream is still running, so the launch latency and the block setup of consecutive small
// kernels (a decode step issues ~12 per layer) overlap instead of adding up. Contract for every kernel launched
// this way: each of its blocks calls wait_then_release() before it reads anything an earlier kernel wrote (the
// wait returns when the previous grid has completed and its writes are visible; since every block of that grid
// waited in turn, every earlier kernel has completed too), and before it exits; it reads such data with
// load_produced below, never through the non-coherent path, which may be scheduled ahead of the wait. Exceptions read before the wait
// only what no kernel of the same step writes: weights, and (the decode attention's early_kv) the step's input
// arrays, which only the step's host-to-device copy writes, and K / V of positions an earlier step appended (a
// shared prefix page is read only once its owner's step has written it: server/prefix_cache.hpp); a kernel that
// wrote either inside a step would have to turn those reads off. One exception reads a kernel's output: the expert
// down GEMM's plan (ExpertSkinnyArgs::plan_ready_early), written by the kernel before last, which had completed
// before the kernel just before passed its wait and released this one. Kernels launched the ordinary way keep ordinary
// stream order. FULCRUM_PDL=0 launches everything the ordinary way (for measurement); read once.
#include <cstdint>
#include <utility>

#include <cuda_runtime.h>

#include "gpu/env_switch.hpp"

namespace fulcrum::gpu {

inline bool dependent_launch_enabled() {
  static const bool enabled = env_switch_on("FULCRUM_PDL");
  return enabled;
}

// Waits for the previous grid, then lets the next one be scheduled (after the wait: at most one grid runs ahead).
__device__ __forceinline__ void wait_then_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Loads of what an earlier kernel of the step wrote, after wait_then_release(): ordinary global loads (ld.global;
// the PTX ISA has griddepcontrol.wait make the prerequisite grids' memory operations visible to the waiting grid).
// Never the non-coherent path (__ldg, ld.global.nc, or a plain load through `const __restrict__`, which the compiler
// may turn into one): it declares the data read-only for the kernel's whole lifetime, which a dependent launch breaks
// (the kernel runs while the one before still writes), so such a load may be scheduled ahead of
// griddepcontrol.wait. Measured on an H200 (acee781): with its plan and SwiGLU rows filled with 0xff before a
// one-token step, the expert gate_up GEMM, which read the plan through __ldg after its wait, computed from the
// fill in every try (MoeSkinnyPathTest.StepReadsOnlyWhatItWrote; FULCRUM_PDL=0 and compute-sanitizer, which both
// serialize the kernels, passed). `volatile`: the compiler keeps them after the wait's asm. The plan arrays were
// read L2-only (.cg) at first: 0.7 / 1.2 / 0.4% slower steps at batch 1 / 4 / 16 on an H100 than these loads
// (docs/benchmarks.md, session 40).
__device__ __forceinline__ int32_t load_produced(const int32_t* p) {
  int32_t v;
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float load_produced(const float* p) {
  float v;
  asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 load_produced(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ float4 load_produced(const float4* p) {
  float4 v;
  asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

// The launch with programmatic stream serialization; `cluster_z` > 1 also groups the grid's blocks into thread block
// clusters of (1, 1, cluster_z) (the grid's z must be a multiple of it).
template <typename... Params, typename... Args>
cudaError_t launch_dependent_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                                       cudaStream_t stream, unsigned cluster_z, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = dependent_launch_enabled() ? 1 : 0;
  config.attrs = attributes;
  config.numAttrs = 1;
  if (cluster_z > 1) {
    attributes[1].id = cudaLaunchAttributeClusterDimension;
    attributes[1].val.clusterDim.x = 1;
    attributes[1].val.clusterDim.y = 1;
    attributes[1].val.clusterDim.z = cluster_z;
    config.numAttrs = 2;
  }
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                             Args&&... args) {
  return launch_dependent_clustered(kernel, grid, block, shared_bytes, stream, 1u, std::forward<Args>(args)...);
}

}  // namespace fulcrum::gpu
