// Grouped GEMM config: pingpong, swapped operands (grouped_gemm_bf16.cuh kSwapAB), tile 128x16x128 (weight rows x group
// rows x K), cluster 1x1: a 128-row weight tile per consumer warp group.
#include "gpu/cutlass/grouped_gemm_bf16.cuh"

namespace fulcrum::gpu::grouped_gemm_detail {
namespace {
using SwapPingpong128 = Bf16GroupedGemm<cute::Shape<cute::_128, cute::_16, cute::_128>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, /*SwapAB=*/true>;
}  // namespace

GroupedGemmStatus prepare_swap_pingpong_128x16x128(int device, int sm_count, int max_groups, ConfigFacts* facts) {
  return prepare_config<SwapPingpong128>(device, sm_count, max_groups, facts);
}

GroupedGemmStatus run_swap_pingpong_128x16x128(const GroupedGemmArgs& args, const GroupedGemmLimits& limits, void* workspace,
                                         CUstream_st* stream) {
  return run_config<SwapPingpong128>(args, static_cast<int>(GroupedGemmConfig::kSwapPingpong128x16x128), limits, workspace, stream);
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
