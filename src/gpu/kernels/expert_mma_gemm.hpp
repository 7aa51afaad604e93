#pragma once
// The tensor-core kernels of the expert skinny GEMMs with bf16 weights (expert_mma_gemm.cu), behind
// launch_expert_skinny_gemm (expert_skinny_gemm.hpp), which checks the arguments and chooses them.
#include <cuda_runtime.h>

#include "gpu/kernels/expert_skinny_gemm.hpp"

namespace fulcrum::gpu {

// a: checked by launch_expert_skinny_gemm, bf16 weights.
cudaError_t launch_expert_mma_gemm(const ExpertSkinnyArgs& a, cudaStream_t stream);

}  // namespace fulcrum::gpu
