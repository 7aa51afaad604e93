// RMSNorm (one block per row, sum of squares in double like the CPU reference) and rotary embedding
// (rotation by host-computed cos/sin tables, so that the angles are the CPU's bit for bit).
#include "backend/cuda/kernels.hpp"
#include "backend/cuda/launch_util.cuh"

namespace fulcrum::cuda {
namespace {

__global__ void rms_norm_kernel(const float* x, const float* weight, float* out, int64_t dim, float eps) {
  __shared__ double scratch[32];
  const float* in = x + blockIdx.x * dim;
  float* o = out + blockIdx.x * dim;
  double sum_sq = 0;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum_sq += static_cast<double>(in[i]) * in[i];
  sum_sq = block_sum(sum_sq, scratch);
  const float variance = static_cast<float>(sum_sq / static_cast<double>(dim));
  const float inv_rms = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(variance, eps)));
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = __fmul_rn(weight[i], __fmul_rn(in[i], inv_rms));
}

__global__ void rope_kernel(float* x, const float* cos_sin, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                            int64_t half) {
  const int64_t n = num_tokens * num_heads * half;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n; idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = idx % half, th = idx / half, t = th / num_heads;
    float* v = x + th * head_dim;  // (token, head) row; an odd head_dim's last value stays, as on the CPU
    const float c = cos_sin[t * 2 * half + i], s = cos_sin[t * 2 * half + half + i];
    const float a = v[i], b = v[i + half];
    v[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    v[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
}

}  // namespace

cudaError_t launch_rms_norm(const float* x, const float* weight, float* out, int64_t num_rows, int64_t dim, float eps,
                            cudaStream_t stream) {
  if (num_rows == 0 || dim == 0) return cudaSuccess;
  rms_norm_kernel<<<static_cast<unsigned int>(num_rows), kThreadsPerBlock, 0, stream>>>(x, weight, out, dim, eps);
  return cudaGetLastError();
}

cudaError_t launch_rope(float* x, const float* cos_sin, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                        cudaStream_t stream) {
  const int64_t half = head_dim / 2;
  if (num_tokens * num_heads * half == 0) return cudaSuccess;
  rope_kernel<<<grid_for(num_tokens * num_heads * half), kThreadsPerBlock, 0, stream>>>(x, cos_sin, num_tokens,
                                                                                         num_heads, head_dim, half);
  return cudaGetLastError();
}

}  // namespace fulcrum::cuda
