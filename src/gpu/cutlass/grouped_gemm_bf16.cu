// Grouped GEMM entry points (grouped_gemm.hpp): device facts, workspace layout, argument checks and the
// dispatch to the per-config kernels (grouped_gemm_bf16_*.cu, one config each).
#include <algorithm>

#include <cuda_runtime.h>

#include "gpu/cutlass/grouped_gemm.hpp"
#include "gpu/cutlass/grouped_gemm_detail.hpp"

namespace fulcrum::gpu {

using grouped_gemm_detail::align_up;
using grouped_gemm_detail::ConfigFacts;

GroupedGemmStatus prepare_grouped_gemm(int device, int max_groups, GroupedGemmLimits* limits) {
  if (limits == nullptr || max_groups < 1) return {"prepare_grouped_gemm: null limits or max_groups < 1", 0};
  int previous = 0;
  cudaError_t status = cudaGetDevice(&previous);
  if (status == cudaSuccess) status = cudaSetDevice(device);
  if (status != cudaSuccess) return {"cudaSetDevice (grouped GEMM)", static_cast<int>(status)};
  GroupedGemmLimits out;
  out.device = device;
  out.max_groups = max_groups;
  status = cudaDeviceGetAttribute(&out.sm_count, cudaDevAttrMultiProcessorCount, device);
  GroupedGemmStatus result;
  if (status != cudaSuccess) {
    result = {"cudaDeviceGetAttribute (SM count)", static_cast<int>(status)};
  } else {
    ConfigFacts facts[kNumGroupedGemmConfigs];
    result = grouped_gemm_detail::prepare_pingpong_64x128x64(device, out.sm_count, max_groups, &facts[0]);
    if (result.ok()) result = grouped_gemm_detail::prepare_cooperative_256x128x64(device, out.sm_count, max_groups, &facts[1]);
    if (result.ok()) result = grouped_gemm_detail::prepare_pingpong_128x128x64(device, out.sm_count, max_groups, &facts[2]);
    if (result.ok()) {
      result = grouped_gemm_detail::prepare_swap_cooperative_128x16x128(device, out.sm_count, max_groups, &facts[3]);
    }
    if (result.ok()) {
      result = grouped_gemm_detail::prepare_swap_cooperative_128x32x128(device, out.sm_count, max_groups, &facts[4]);
    }
    size_t arrays_bytes = 0;
    for (int c = 0; c < kNumGroupedGemmConfigs && result.ok(); ++c) {
      out.max_active_clusters[c] = facts[c].max_active_clusters;
      out.cutlass_workspace_bytes = std::max(out.cutlass_workspace_bytes, align_up(facts[c].cutlass_workspace_bytes));
      arrays_bytes = std::max(arrays_bytes, facts[c].group_arrays_bytes);
    }
    out.group_arrays_bytes = align_up(arrays_bytes);
    out.workspace_bytes = out.cutlass_workspace_bytes + kGroupedGemmRegions * out.group_arrays_bytes;
  }
  cudaSetDevice(previous);
  if (result.ok()) *limits = out;
  return result;
}

namespace {

using grouped_gemm_detail::GroupedGemmStage;

// Null when args may run under limits with this workspace, else why not.
const char* args_problem(const GroupedGemmArgs& args, const GroupedGemmLimits& limits, const void* workspace) {
  if (args.num_groups < 0 || args.num_groups > limits.max_groups) {
    return "grouped GEMM: group count outside [0, limits.max_groups]";
  }
  if (grouped_gemm_shape_problem(args.n, args.k) != nullptr) return "grouped GEMM: N or K not a positive multiple of 8";
  if (args.a == nullptr || args.offsets == nullptr || args.b == nullptr || args.num_b < 1 || args.d == nullptr ||
      workspace == nullptr) {
    return "grouped GEMM: null pointer or num_b < 1";
  }
  if (!grouped_gemm_aligned(args.a) || !grouped_gemm_aligned(args.d)) return "grouped GEMM: a or d not 16-byte aligned";
  return nullptr;
}

GroupedGemmStatus run_stage(const GroupedGemmStage& stage, GroupedGemmConfig config, const GroupedGemmLimits& limits,
                            void* workspace, CUstream_st* stream) {
  switch (config) {
    case GroupedGemmConfig::kPingpong64x128x64:
      return grouped_gemm_detail::run_pingpong_64x128x64(stage, limits, workspace, stream);
    case GroupedGemmConfig::kCooperative256x128x64:
      return grouped_gemm_detail::run_cooperative_256x128x64(stage, limits, workspace, stream);
    case GroupedGemmConfig::kPingpong128x128x64:
      return grouped_gemm_detail::run_pingpong_128x128x64(stage, limits, workspace, stream);
    case GroupedGemmConfig::kSwapCooperative128x16x128:
      return grouped_gemm_detail::run_swap_cooperative_128x16x128(stage, limits, workspace, stream);
    case GroupedGemmConfig::kSwapCooperative128x32x128:
      return grouped_gemm_detail::run_swap_cooperative_128x32x128(stage, limits, workspace, stream);
  }
  return {"grouped GEMM: unknown config", static_cast<int>(cudaErrorInvalidValue)};
}

}  // namespace

GroupedGemmStatus run_grouped_gemm(const GroupedGemmArgs& args, GroupedGemmConfig config,
                                   const GroupedGemmLimits& limits, void* workspace, CUstream_st* stream) {
  if (args.num_groups == 0) return {};
  if (const char* problem = args_problem(args, limits, workspace)) {
    return {problem, static_cast<int>(cudaErrorInvalidValue)};
  }
  GroupedGemmStage stage;
  stage.setup[0] = &args;
  stage.setup_count = 1;
  stage.launch_region = 0;
  stage.launch_groups = args.num_groups;
  return run_stage(stage, config, limits, workspace, stream);
}

GroupedGemmStatus setup_grouped_gemm_pair(const GroupedGemmArgs& first, const GroupedGemmArgs& second,
                                          GroupedGemmConfig config, const GroupedGemmLimits& limits, void* workspace,
                                          CUstream_st* stream) {
  for (const GroupedGemmArgs* args : {&first, &second}) {
    if (const char* problem = args_problem(*args, limits, workspace)) {
      return {problem, static_cast<int>(cudaErrorInvalidValue)};
    }
  }
  if (first.num_groups == 0 && second.num_groups == 0) return {};
  GroupedGemmStage stage;
  stage.setup[0] = &first;
  stage.setup[1] = &second;
  stage.setup_count = 2;
  return run_stage(stage, config, limits, workspace, stream);
}

GroupedGemmStatus launch_grouped_gemm(const GroupedGemmArgs& args, int region, GroupedGemmConfig config,
                                      const GroupedGemmLimits& limits, void* workspace, CUstream_st* stream) {
  if (args.num_groups == 0) return {};
  if (region < 0 || region >= kGroupedGemmRegions) {
    return {"grouped GEMM: array region outside [0, kGroupedGemmRegions)", static_cast<int>(cudaErrorInvalidValue)};
  }
  if (const char* problem = args_problem(args, limits, workspace)) {
    return {problem, static_cast<int>(cudaErrorInvalidValue)};
  }
  GroupedGemmStage stage;
  stage.launch_region = region;
  stage.launch_groups = args.num_groups;
  return run_stage(stage, config, limits, workspace, stream);
}

}  // namespace fulcrum::gpu
