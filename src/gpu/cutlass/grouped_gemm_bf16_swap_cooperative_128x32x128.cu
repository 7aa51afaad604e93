// Grouped GEMM config: cooperative, swapped operands (grouped_gemm_bf16.cuh kSwapAB), tile 128x32x128 (weight
// rows x group rows x K), cluster 1x1: groups of up to 32 rows in one N tile.
#include "gpu/cutlass/grouped_gemm_bf16.cuh"

namespace fulcrum::gpu::grouped_gemm_detail {
namespace {
using SwapCooperative32 = Bf16GroupedGemm<cute::Shape<cute::_128, cute::_32, cute::_128>,
                                          cute::Shape<cute::_1, cute::_1, cute::_1>,
                                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                          cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, /*SwapAB=*/true>;
}  // namespace

GroupedGemmStatus prepare_swap_cooperative_128x32x128(int device, int sm_count, int max_groups, ConfigFacts* facts) {
  return prepare_config<SwapCooperative32>(device, sm_count, max_groups, facts);
}

GroupedGemmStatus run_swap_cooperative_128x32x128(const GroupedGemmStage& stage, const GroupedGemmLimits& limits,
                                                  void* workspace, CUstream_st* stream) {
  return run_config<SwapCooperative32>(stage, static_cast<int>(GroupedGemmConfig::kSwapCooperative128x32x128), limits,
                                       workspace, stream);
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
