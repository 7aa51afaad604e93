// Grouped GEMM config: cooperative, tile 128x256x64, cluster 2x1 (two warp groups on 64x256 halves: the wide N
// tile reads each A row once per 256 columns; for N = 2048 at 4096-16384 tokens).
#include "gpu/cutlass/grouped_gemm_bf16.cuh"

namespace fulcrum::gpu::grouped_gemm_detail {
namespace {
using Cooperative128x256 = Bf16GroupedGemm<cute::Shape<cute::_128, cute::_256, cute::_64>,
                                           cute::Shape<cute::_2, cute::_1, cute::_1>,
                                           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                           cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
}  // namespace

GroupedGemmStatus prepare_cooperative_128x256x64(int device, int sm_count, int max_groups, ConfigFacts* facts) {
  return prepare_config<Cooperative128x256>(device, sm_count, max_groups, facts);
}

GroupedGemmStatus run_cooperative_128x256x64(const GroupedGemmArgs& args, const GroupedGemmLimits& limits,
                                             void* workspace, CUstream_st* stream) {
  return run_config<Cooperative128x256>(args, static_cast<int>(GroupedGemmConfig::kCooperative128x256x64), limits,
                                        workspace, stream);
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
