#include "gpu/dense_gemm.hpp"

#include <cstdint>

#include "backend/cuda/cuda_check.hpp"
#include "eplb/error.hpp"
#include "gpu/kernels/skinny_gemm.hpp"

namespace fulcrum::gpu {
namespace {
// cuBLAS's recommendation for Hopper is 32 MiB; a captured graph must not make cuBLAS allocate.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
}  // namespace

DenseGemm::DenseGemm(CUstream_st* stream, int device_idx) : stream_(stream) {
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx));
  FULCRUM_CUBLAS_CHECK(cublasCreate(&handle_));
  FULCRUM_CUBLAS_CHECK(cublasSetStream(handle_, stream_));
  FULCRUM_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
  FULCRUM_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace_, kWorkspaceBytes));
}

DenseGemm::~DenseGemm() {
  if (handle_ != nullptr) cublasDestroy(handle_);
  if (workspace_ != nullptr) cudaFree(workspace_);
}

void DenseGemm::run(const uint16_t* x, const uint16_t* w, int64_t m, int64_t n, int64_t k, void* out, GemmOut out_type) {
  if (m == 0) return;
  // Decode-sized steps where the skinny GEMM beat cuBLAS in tests_cuda/gpu_skinny_gemm_test.cpp's timings on an
  // H200 (one row: QKV 10.8 vs 13.7 us, O 9.3 vs 17.3, router 5.6 vs 13.9, LM head 144 vs 152; up to 8 rows with
  // n <= 2048: O 14.1 vs 17.1 us at m = 8; cuBLAS won QKV and the LM head from 4 rows). A given (m, n) always
  // takes the same path.
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out) % 4 == 0;
  if ((m == 1 || (m <= kSkinnyGemmMaxRows && n <= 2048)) && k % 8 == 0 && aligned && n <= INT32_MAX && k <= INT32_MAX && use_skinny_) {
    const cudaError_t status = launch_skinny_gemm(
        x, w, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
        out_type == GemmOut::kF32 ? static_cast<float*>(out) : nullptr,
        out_type == GemmOut::kBf16 ? static_cast<uint16_t*>(out) : nullptr, stream_);
    FULCRUM_CHECK(status == cudaSuccess, "skinny GEMM [{}, {}] x [{}, {}]^T: {}", m, k, n, k, cudaGetErrorString(status));
    return;
  }
  FULCRUM_CHECK(m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX, "dense GEMM [{}, {}] x [{}, {}]^T too large", m, k, n, k);
  // Row-major out [m, n] is column-major out^T [n, m] = W^T (op T on the column-major [k, n] view of W) x x^T.
  const float alpha = 1.0f, beta = 0.0f;
  FULCRUM_CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                                    static_cast<int>(k), &alpha, w, CUDA_R_16BF, static_cast<int>(k), x, CUDA_R_16BF,
                                    static_cast<int>(k), &beta, out, out_type == GemmOut::kF32 ? CUDA_R_32F : CUDA_R_16BF,
                                    static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace fulcrum::gpu
