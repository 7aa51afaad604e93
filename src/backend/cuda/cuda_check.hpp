#pragma once
// One macro family for CUDA runtime and cuBLAS status: a failure throws fulcrum::Error carrying
// file:line, the failing expression and the status name and string. Host code only (no fmt in .cu files:
// kernels return their launch status to the host code that checks it).
#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace fulcrum::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t status, const char* expr, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line);

}  // namespace fulcrum::cuda

#define FULCRUM_CUDA_CHECK(expr)                                                                      \
  do {                                                                                                \
    const cudaError_t fulcrum_cuda_status_ = (expr);                                                  \
    if (fulcrum_cuda_status_ != cudaSuccess)                                                          \
      ::fulcrum::cuda::throw_cuda_error(fulcrum_cuda_status_, #expr, __FILE__, __LINE__);             \
  } while (0)

#define FULCRUM_CUBLAS_CHECK(expr)                                                                    \
  do {                                                                                                \
    const cublasStatus_t fulcrum_cublas_status_ = (expr);                                             \
    if (fulcrum_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                              \
      ::fulcrum::cuda::throw_cublas_error(fulcrum_cublas_status_, #expr, __FILE__, __LINE__);         \
  } while (0)
