#pragma once
// Per-config entry points of the FP8 blockwise grouped GEMM (one .cu per CUTLASS config, so they compile in
// parallel); grouped_gemm_fp8.cu dispatches to them. Internal to src/gpu/cutlass. The workspace layout is the
// bf16 one's: [CUTLASS workspace, limits.cutlass_workspace_bytes][per-group arrays].
#include "gpu/cutlass/grouped_gemm_detail.hpp"  // ConfigFacts, align_up
#include "gpu/cutlass/grouped_gemm_fp8.hpp"

namespace fulcrum::gpu::grouped_gemm_detail {

GroupedGemmStatus prepare_fp8_pingpong_64x128x128(int device, int sm_count, int max_groups, ConfigFacts* facts);
GroupedGemmStatus run_fp8_pingpong_64x128x128(const Fp8GroupedGemmArgs& args, const Fp8GroupedGemmLimits& limits,
                                              void* workspace, CUstream_st* stream);
GroupedGemmStatus prepare_fp8_cooperative_128x128x128(int device, int sm_count, int max_groups, ConfigFacts* facts);
GroupedGemmStatus run_fp8_cooperative_128x128x128(const Fp8GroupedGemmArgs& args, const Fp8GroupedGemmLimits& limits,
                                                  void* workspace, CUstream_st* stream);
GroupedGemmStatus prepare_fp8_swap_cooperative_128x16x128(int device, int sm_count, int max_groups,
                                                          ConfigFacts* facts);
GroupedGemmStatus run_fp8_swap_cooperative_128x16x128(const Fp8GroupedGemmArgs& args,
                                                      const Fp8GroupedGemmLimits& limits, void* workspace,
                                                      CUstream_st* stream);
GroupedGemmStatus prepare_fp8_swap_cooperative_128x32x128(int device, int sm_count, int max_groups,
                                                          ConfigFacts* facts);
GroupedGemmStatus run_fp8_swap_cooperative_128x32x128(const Fp8GroupedGemmArgs& args,
                                                      const Fp8GroupedGemmLimits& limits, void* workspace,
                                                      CUstream_st* stream);

}  // namespace fulcrum::gpu::grouped_gemm_detail
