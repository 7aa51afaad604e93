// Grouped GEMM config: pingpong, tile 128x128x64, cluster 1x2 (the measured best at 4096-16384 tokens: a tile per
// consumer warp group, one group's epilogue under the other's main loop).
#include "gpu/cutlass/grouped_gemm_bf16.cuh"

namespace fulcrum::gpu::grouped_gemm_detail {
namespace {
using Pingpong128 = Bf16GroupedGemm<cute::Shape<cute::_128, cute::_128, cute::_64>,
                                    cute::Shape<cute::_1, cute::_2, cute::_1>,
                                    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                    cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
}  // namespace

GroupedGemmStatus prepare_pingpong_128x128x64(int device, int sm_count, int max_groups, ConfigFacts* facts) {
  return prepare_config<Pingpong128>(device, sm_count, max_groups, facts);
}

GroupedGemmStatus run_pingpong_128x128x64(const GroupedGemmStage& stage, const GroupedGemmLimits& limits,
                                          void* workspace, CUstream_st* stream) {
  return run_config<Pingpong128>(stage, static_cast<int>(GroupedGemmConfig::kPingpong128x128x64), limits, workspace,
                                 stream);
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
