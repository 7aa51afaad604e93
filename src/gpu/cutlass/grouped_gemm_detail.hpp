#pragma once
// Per-config entry points of the grouped GEMM (one .cu per CUTLASS config, so they compile in parallel);
// grouped_gemm_bf16.cu dispatches to them. Internal to src/gpu/cutlass.
#include <cstddef>

#include "gpu/cutlass/grouped_gemm.hpp"

namespace fulcrum::gpu::grouped_gemm_detail {

// What one config needs from the device and of the workspace.
struct ConfigFacts {
  int max_active_clusters = 0;
  size_t cutlass_workspace_bytes = 0;
  size_t group_arrays_bytes = 0;  // problem shapes, pointers and strides for max_groups groups
};

// Workspace layout: [CUTLASS workspace, limits.cutlass_workspace_bytes][kGroupedGemmRegions regions of per-group
// arrays, limits.group_arrays_bytes each].
constexpr size_t kWorkspaceAlignment = 256;
constexpr size_t align_up(size_t bytes) { return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment; }

// One call into a config: setup_count (0-2) GEMMs' group arrays written by one setup launch (setup[j]'s into region
// j), then, when launch_region >= 0, the GEMM over that region's arrays with launch_groups groups.
struct GroupedGemmStage {
  const GroupedGemmArgs* setup[kGroupedGemmRegions] = {};
  int setup_count = 0;
  int launch_region = -1;
  int launch_groups = 0;
};

GroupedGemmStatus prepare_pingpong_64x128x64(int device, int sm_count, int max_groups, ConfigFacts* facts);
GroupedGemmStatus run_pingpong_64x128x64(const GroupedGemmStage& stage, const GroupedGemmLimits& limits, void* workspace,
                                         CUstream_st* stream);
GroupedGemmStatus prepare_pingpong_128x128x64(int device, int sm_count, int max_groups, ConfigFacts* facts);
GroupedGemmStatus run_pingpong_128x128x64(const GroupedGemmStage& stage, const GroupedGemmLimits& limits,
                                          void* workspace, CUstream_st* stream);
GroupedGemmStatus prepare_cooperative_256x128x64(int device, int sm_count, int max_groups, ConfigFacts* facts);
GroupedGemmStatus run_cooperative_256x128x64(const GroupedGemmStage& stage, const GroupedGemmLimits& limits,
                                             void* workspace, CUstream_st* stream);
GroupedGemmStatus prepare_swap_cooperative_128x16x128(int device, int sm_count, int max_groups, ConfigFacts* facts);
GroupedGemmStatus run_swap_cooperative_128x16x128(const GroupedGemmStage& stage, const GroupedGemmLimits& limits,
                                                  void* workspace, CUstream_st* stream);
GroupedGemmStatus prepare_swap_cooperative_128x32x128(int device, int sm_count, int max_groups, ConfigFacts* facts);
GroupedGemmStatus run_swap_cooperative_128x32x128(const GroupedGemmStage& stage, const GroupedGemmLimits& limits,
                                                  void* workspace, CUstream_st* stream);

}  // namespace fulcrum::gpu::grouped_gemm_detail
