// Row moves and elementwise kernels. Products and sums use the _rn intrinsics so that nvcc does not fuse
// them into FMAs: add_inplace, weighted_sum, gather and scatter match the CPU reference bit for bit.
#include "backend/cuda/kernels.hpp"
#include "backend/cuda/launch_util.cuh"

namespace fulcrum::cuda {
namespace {

__global__ void gather_rows_kernel(const float* x, const int32_t* row_idx, float* out, int64_t num_out_rows,
                                   int64_t width) {
  const int64_t n = num_out_rows * width;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    out[i] = x[int64_t{row_idx[r]} * width + c];
  }
}

__global__ void scatter_rows_kernel(float* dst, const float* src, const int32_t* row_idx, int64_t num_src_rows,
                                    int64_t width) {
  const int64_t n = num_src_rows * width;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    dst[int64_t{row_idx[r]} * width + c] = src[i];
  }
}

__global__ void silu_mul_kernel(const float* gate_up, float* out, int64_t num_rows, int64_t width) {
  const int64_t n = num_rows * width;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    const float gate = gate_up[r * 2 * width + c];
    const float up = gate_up[r * 2 * width + width + c];
    const float silu = __fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate)));
    out[i] = __fmul_rn(silu, up);
  }
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = __fadd_rn(x[i], y[i]);
  }
}

__global__ void weighted_sum_kernel(const float* rows, const float* weights, float* out, int64_t num_tokens, int k,
                                    int64_t dim) {
  const int64_t n = num_tokens * dim;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / dim, d = i % dim;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int64_t entry = t * k + j;
      acc = __fadd_rn(acc, __fmul_rn(rows[entry * dim + d], weights[entry]));
    }
    out[i] = acc;
  }
}

}  // namespace

cudaError_t launch_gather_rows(const float* x, const int32_t* row_idx, float* out, int64_t num_out_rows, int64_t width,
                               cudaStream_t stream) {
  if (num_out_rows * width == 0) return cudaSuccess;
  gather_rows_kernel<<<grid_for(num_out_rows * width), kThreadsPerBlock, 0, stream>>>(x, row_idx, out, num_out_rows,
                                                                                       width);
  return cudaGetLastError();
}

cudaError_t launch_scatter_rows(float* dst, const float* src, const int32_t* row_idx, int64_t num_src_rows,
                                int64_t width, cudaStream_t stream) {
  if (num_src_rows * width == 0) return cudaSuccess;
  scatter_rows_kernel<<<grid_for(num_src_rows * width), kThreadsPerBlock, 0, stream>>>(dst, src, row_idx,
                                                                                         num_src_rows, width);
  return cudaGetLastError();
}

cudaError_t launch_silu_mul(const float* gate_up, float* out, int64_t num_rows, int64_t width, cudaStream_t stream) {
  if (num_rows * width == 0) return cudaSuccess;
  silu_mul_kernel<<<grid_for(num_rows * width), kThreadsPerBlock, 0, stream>>>(gate_up, out, num_rows, width);
  return cudaGetLastError();
}

cudaError_t launch_add_inplace(float* x, const float* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  add_kernel<<<grid_for(n), kThreadsPerBlock, 0, stream>>>(x, y, n);
  return cudaGetLastError();
}

cudaError_t launch_weighted_sum(const float* rows, const float* weights, float* out, int64_t num_tokens, int k,
                                int64_t dim, cudaStream_t stream) {
  if (num_tokens * dim == 0) return cudaSuccess;
  weighted_sum_kernel<<<grid_for(num_tokens * dim), kThreadsPerBlock, 0, stream>>>(rows, weights, out, num_tokens, k,
                                                                                   dim);
  return cudaGetLastError();
}

}  // namespace fulcrum::cuda
