// FP8 grouped GEMM config: cooperative, tile 128x128x128, cluster 1x2 (the probe's faster FP8 config from 4096 tokens).
#include "gpu/cutlass/grouped_gemm_fp8.cuh"

namespace fulcrum::gpu::grouped_gemm_detail {
namespace {
using Fp8Cooperative = Fp8GroupedGemm<cute::Shape<cute::_128, cute::_128, cute::_128>,
                                      cute::Shape<cute::_1, cute::_2, cute::_1>,
                                      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
}  // namespace

GroupedGemmStatus prepare_fp8_cooperative_128x128x128(int device, int sm_count, int max_groups, ConfigFacts* facts) {
  return prepare_fp8_config<Fp8Cooperative>(device, sm_count, max_groups, facts);
}

GroupedGemmStatus run_fp8_cooperative_128x128x128(const Fp8GroupedGemmArgs& args, const Fp8GroupedGemmLimits& limits,
                                                  void* workspace, CUstream_st* stream) {
  return run_fp8_config<Fp8Cooperative>(args, static_cast<int>(Fp8GroupedGemmConfig::kCooperative128x128x128), limits,
                                        workspace, stream);
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
