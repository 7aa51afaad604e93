// FP8 grouped GEMM config: pingpong, tile 64x128x128, cluster 1x1 (the probe's faster FP8 config up to 1024 tokens).
#include "gpu/cutlass/grouped_gemm_fp8.cuh"

namespace fulcrum::gpu::grouped_gemm_detail {
namespace {
using Fp8Pingpong = Fp8GroupedGemm<cute::Shape<cute::_64, cute::_128, cute::_128>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                                   cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                                   cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
}  // namespace

GroupedGemmStatus prepare_fp8_pingpong_64x128x128(int device, int sm_count, int max_groups, ConfigFacts* facts) {
  return prepare_fp8_config<Fp8Pingpong>(device, sm_count, max_groups, facts);
}

GroupedGemmStatus run_fp8_pingpong_64x128x128(const Fp8GroupedGemmArgs& args, const Fp8GroupedGemmLimits& limits,
                                              void* workspace, CUstream_st* stream) {
  return run_fp8_config<Fp8Pingpong>(args, static_cast<int>(Fp8GroupedGemmConfig::kPingpong64x128x128), limits,
                                     workspace, stream);
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
