// Grouped GEMM config: pingpong, tile 64x64x128, cluster 1x1 (decode-sized steps: tiles of 64 weight rows halve
// the last wave's imbalance when every group holds one or two rows and the weights stream from HBM).
#include "gpu/cutlass/grouped_gemm_bf16.cuh"

namespace fulcrum::gpu::grouped_gemm_detail {
namespace {
using Pingpong = Bf16GroupedGemm<cute::Shape<cute::_64, cute::_64, cute::_128>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
}  // namespace

GroupedGemmStatus prepare_pingpong_64x64x128(int device, int sm_count, int max_groups, ConfigFacts* facts) {
  return prepare_config<Pingpong>(device, sm_count, max_groups, facts);
}

GroupedGemmStatus run_pingpong_64x64x128(const GroupedGemmArgs& args, const GroupedGemmLimits& limits, void* workspace,
                                         CUstream_st* stream) {
  return run_config<Pingpong>(args, static_cast<int>(GroupedGemmConfig::kPingpong64x64x128), limits, workspace, stream);
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
