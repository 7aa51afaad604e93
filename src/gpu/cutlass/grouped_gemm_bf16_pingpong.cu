// Grouped GEMM config: pingpong, tile 64x128x64, cluster 1x1 (the measured best at 256-1024 tokens).
#include "gpu/cutlass/grouped_gemm_bf16.cuh"

namespace fulcrum::gpu::grouped_gemm_detail {
namespace {
using Pingpong = Bf16GroupedGemm<cute::Shape<cute::_64, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
}  // namespace

GroupedGemmStatus prepare_pingpong_64x128x64(int device, int sm_count, int max_groups, ConfigFacts* facts) {
  return prepare_config<Pingpong>(device, sm_count, max_groups, facts);
}

GroupedGemmStatus run_pingpong_64x128x64(const GroupedGemmStage& stage, const GroupedGemmLimits& limits, void* workspace,
                                         CUstream_st* stream) {
  return run_config<Pingpong>(stage, static_cast<int>(GroupedGemmConfig::kPingpong64x128x64), limits, workspace, stream);
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
