// Grouped GEMM config: cooperative, swapped operands (grouped_gemm_bf16.cuh kSwapAB), tile 256x16x64 (weight rows x group
// rows x K), cluster 1x1: 256 weight rows a tile (128 per consumer warp group).
#include "gpu/cutlass/grouped_gemm_bf16.cuh"

namespace fulcrum::gpu::grouped_gemm_detail {
namespace {
using SwapCooperative256 = Bf16GroupedGemm<cute::Shape<cute::_256, cute::_16, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, /*SwapAB=*/true>;
}  // namespace

GroupedGemmStatus prepare_swap_cooperative_256x16x64(int device, int sm_count, int max_groups, ConfigFacts* facts) {
  return prepare_config<SwapCooperative256>(device, sm_count, max_groups, facts);
}

GroupedGemmStatus run_swap_cooperative_256x16x64(const GroupedGemmArgs& args, const GroupedGemmLimits& limits, void* workspace,
                                         CUstream_st* stream) {
  return run_config<SwapCooperative256>(args, static_cast<int>(GroupedGemmConfig::kSwapCooperative256x16x64), limits, workspace, stream);
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
