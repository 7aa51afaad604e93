// FP8 grouped GEMM entry points (grouped_gemm_fp8.hpp): device facts, workspace layout, argument checks and the
// dispatch to the per-config kernels (grouped_gemm_fp8_{pingpong,cooperative,swap_cooperative_*}.cu).
#include <algorithm>

#include <cuda_runtime.h>

#include "gpu/cutlass/grouped_gemm_fp8.hpp"
#include "gpu/cutlass/grouped_gemm_fp8_detail.hpp"

namespace fulcrum::gpu {

using grouped_gemm_detail::align_up;
using grouped_gemm_detail::ConfigFacts;

namespace {
bool aligned_to(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
}  // namespace

GroupedGemmStatus prepare_fp8_grouped_gemm(int device, int max_groups, Fp8GroupedGemmLimits* limits) {
  if (limits == nullptr || max_groups < 1) return {"prepare_fp8_grouped_gemm: null limits or max_groups < 1", 0};
  int previous = 0;
  cudaError_t status = cudaGetDevice(&previous);
  if (status == cudaSuccess) status = cudaSetDevice(device);
  if (status != cudaSuccess) return {"cudaSetDevice (FP8 grouped GEMM)", static_cast<int>(status)};
  Fp8GroupedGemmLimits out;
  out.device = device;
  out.max_groups = max_groups;
  status = cudaDeviceGetAttribute(&out.sm_count, cudaDevAttrMultiProcessorCount, device);
  GroupedGemmStatus result;
  if (status != cudaSuccess) {
    result = {"cudaDeviceGetAttribute (SM count)", static_cast<int>(status)};
  } else {
    ConfigFacts facts[kNumFp8GroupedGemmConfigs];
    using Prepare = GroupedGemmStatus (*)(int, int, int, ConfigFacts*);
    constexpr Prepare kPrepare[kNumFp8GroupedGemmConfigs] = {  // in Fp8GroupedGemmConfig order
        grouped_gemm_detail::prepare_fp8_pingpong_64x128x128, grouped_gemm_detail::prepare_fp8_cooperative_128x128x128,
        grouped_gemm_detail::prepare_fp8_swap_cooperative_128x16x128,
        grouped_gemm_detail::prepare_fp8_swap_cooperative_128x32x128};
    for (int c = 0; c < kNumFp8GroupedGemmConfigs && result.ok(); ++c) {
      result = kPrepare[c](device, out.sm_count, max_groups, &facts[c]);
    }
    size_t arrays_bytes = 0;
    for (int c = 0; c < kNumFp8GroupedGemmConfigs && result.ok(); ++c) {
      out.max_active_clusters[c] = facts[c].max_active_clusters;
      out.cutlass_workspace_bytes = std::max(out.cutlass_workspace_bytes, align_up(facts[c].cutlass_workspace_bytes));
      arrays_bytes = std::max(arrays_bytes, facts[c].group_arrays_bytes);
    }
    out.workspace_bytes = out.cutlass_workspace_bytes + arrays_bytes;
  }
  cudaSetDevice(previous);
  if (result.ok()) *limits = out;
  return result;
}

GroupedGemmStatus run_fp8_grouped_gemm(const Fp8GroupedGemmArgs& args, Fp8GroupedGemmConfig config,
                                       const Fp8GroupedGemmLimits& limits, void* workspace, CUstream_st* stream) {
  if (args.num_groups == 0) return {};
  if (args.num_groups < 0 || args.num_groups > limits.max_groups) {
    return {"run_fp8_grouped_gemm: group count outside [0, limits.max_groups]", static_cast<int>(cudaErrorInvalidValue)};
  }
  if (fp8_grouped_gemm_shape_problem(args.n, args.k) != nullptr) {
    return {"run_fp8_grouped_gemm: N or K not a positive multiple of 128", static_cast<int>(cudaErrorInvalidValue)};
  }
  if (args.a == nullptr || args.a_scales == nullptr || args.offsets == nullptr || args.b == nullptr ||
      args.b_scales == nullptr || args.num_b < 1 || args.d == nullptr || workspace == nullptr) {
    return {"run_fp8_grouped_gemm: null pointer or num_b < 1", static_cast<int>(cudaErrorInvalidValue)};
  }
  // The b and b_scales pointers lie in device memory: their alignment is the caller's promise (no host read).
  if (!aligned_to(args.a, 16) || !aligned_to(args.d, 16) || !aligned_to(args.a_scales, 4)) {
    return {"run_fp8_grouped_gemm: a or d not 16-byte aligned, or a_scales not 4-byte aligned",
            static_cast<int>(cudaErrorInvalidValue)};
  }
  switch (config) {
    case Fp8GroupedGemmConfig::kPingpong64x128x128:
      return grouped_gemm_detail::run_fp8_pingpong_64x128x128(args, limits, workspace, stream);
    case Fp8GroupedGemmConfig::kCooperative128x128x128:
      return grouped_gemm_detail::run_fp8_cooperative_128x128x128(args, limits, workspace, stream);
    case Fp8GroupedGemmConfig::kSwapCooperative128x16x128:
      return grouped_gemm_detail::run_fp8_swap_cooperative_128x16x128(args, limits, workspace, stream);
    case Fp8GroupedGemmConfig::kSwapCooperative128x32x128:
      return grouped_gemm_detail::run_fp8_swap_cooperative_128x32x128(args, limits, workspace, stream);
  }
  return {"run_fp8_grouped_gemm: unknown config", static_cast<int>(cudaErrorInvalidValue)};
}

}  // namespace fulcrum::gpu
