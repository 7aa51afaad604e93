// FP8 grouped GEMM config: cooperative, swapped operands (grouped_gemm_fp8.cuh kSwapAB), tile 128x16x128 (weight
// rows x group rows x K), cluster 1x1: 128 weight rows a tile over both consumer warp groups.
#include "gpu/cutlass/grouped_gemm_fp8.cuh"

namespace fulcrum::gpu::grouped_gemm_detail {
namespace {
using Fp8SwapCooperative16 = Fp8GroupedGemm<cute::Shape<cute::_128, cute::_16, cute::_128>,
                                            cute::Shape<cute::_1, cute::_1, cute::_1>,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                            cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, /*SwapAB=*/true>;
}  // namespace

GroupedGemmStatus prepare_fp8_swap_cooperative_128x16x128(int device, int sm_count, int max_groups,
                                                          ConfigFacts* facts) {
  return prepare_fp8_config<Fp8SwapCooperative16>(device, sm_count, max_groups, facts);
}

GroupedGemmStatus run_fp8_swap_cooperative_128x16x128(const Fp8GroupedGemmArgs& args,
                                                      const Fp8GroupedGemmLimits& limits, void* workspace,
                                                      CUstream_st* stream) {
  return run_fp8_config<Fp8SwapCooperative16>(
      args, static_cast<int>(Fp8GroupedGemmConfig::kSwapCooperative128x16x128), limits, workspace, stream);
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
