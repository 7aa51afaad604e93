#include "backend/cuda/cuda_check.hpp"

#include <fmt/format.h>

#include "eplb/error.hpp"

namespace fulcrum::cuda {

void throw_cuda_error(cudaError_t status, const char* expr, const char* file, int line) {
  throw Error(fmt::format("{}:{}: CUDA error {} ({}) in {}", file, line, cudaGetErrorName(status),
                          cudaGetErrorString(status), expr));
}

void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line) {
  throw Error(fmt::format("{}:{}: cuBLAS error {} ({}) in {}", file, line, cublasGetStatusName(status),
                          cublasGetStatusString(status), expr));
}

}  // namespace fulcrum::cuda
