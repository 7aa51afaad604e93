// Grouped GEMM config: cooperative, tile 256x128x64, cluster 1x2 (the large-step config before pingpong 128x128x64;
// kept for side-by-side measurement, FULCRUM_BF16_GEMM_CONFIGS).
#include "gpu/cutlass/grouped_gemm_bf16.cuh"

namespace fulcrum::gpu::grouped_gemm_detail {
namespace {
using Cooperative = Bf16GroupedGemm<cute::Shape<cute::_256, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_2, cute::_1>,
                                    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
}  // namespace

GroupedGemmStatus prepare_cooperative_256x128x64(int device, int sm_count, int max_groups, ConfigFacts* facts) {
  return prepare_config<Cooperative>(device, sm_count, max_groups, facts);
}

GroupedGemmStatus run_cooperative_256x128x64(const GroupedGemmStage& stage, const GroupedGemmLimits& limits,
                                             void* workspace, CUstream_st* stream) {
  return run_config<Cooperative>(stage, static_cast<int>(GroupedGemmConfig::kCooperative256x128x64), limits, workspace,
                                 stream);
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
