// The GPU engine's per-token kernels: embedding, fused residual add + RMSNorm, q/k-norm + RoPE + KV append,
// SwiGLU (step_ops.hpp). They repeat the fp32 operations of the CPU reference (step_ops_reference.cpp) in its
// order, written with _rn intrinsics so that nvcc contracts nothing into an FMA; the sums of squares are in
// double as there, so only summation order and the device's cosf / sinf / expf ulps differ.
#include <algorithm>

#include <cuda_bf16.h>

#include "backend/cuda/launch_util.cuh"
#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/step_ops.hpp"

namespace fulcrum::gpu {
namespace {

constexpr int kMaxVectorHidden = 8192;  // add_rms_norm's fast path: one 8-value vector per thread, <= 1024 threads
constexpr int kScalarThreads = 256;
constexpr int kQkWarps = 8;  // heads per block of the attention prologue (one warp each)

__device__ __forceinline__ float bf16_to_f32(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}
__device__ __forceinline__ uint16_t f32_to_bf16(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }

// Value 2k of 8 bf16 is the low half of word k (little endian).
__device__ __forceinline__ void unpack8(const uint4 bits, float (&f)[8]) {
  const uint32_t w[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = __uint_as_float(w[k] << 16);
    f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return static_cast<uint32_t>(f32_to_bf16(lo)) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
}
__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}

// 1 / sqrt(mean + eps) from a row's double sum of squares, as the reference's inv_rms.
__device__ __forceinline__ float inv_rms_of(double sum_sq, int dim, float eps) {
  const float variance = static_cast<float>(sum_sq / static_cast<double>(dim));
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(variance, eps)));
}
// weight * (x * inv_rms), the reference's product order.
__device__ __forceinline__ float norm_scale(float weight, float x, float inv_rms) {
  return __fmul_rn(weight, __fmul_rn(x, inv_rms));
}

// ---- embedding: one block per token.
template <bool kVector>
__global__ void embedding_kernel(const uint16_t* table, const int32_t* token_ids, int hidden, float* residual) {
  wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  const int64_t t = blockIdx.x;
  const uint16_t* src = table + static_cast<int64_t>(token_ids[t]) * hidden;  // [H]
  float* dst = residual + t * hidden;                                         // [H]
  if constexpr (kVector) {
    for (int v = threadIdx.x; v < hidden / 8; v += blockDim.x) {
      float f[8];
      unpack8(reinterpret_cast<const uint4*>(src)[v], f);
      reinterpret_cast<float4*>(dst)[2 * v] = make_float4(f[0], f[1], f[2], f[3]);
      reinterpret_cast<float4*>(dst)[2 * v + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = bf16_to_f32(src[i]);
  }
}

// ---- add + RMSNorm, fast path: one block per output row, thread v holds values [8v, 8v + 8) of the row in
// registers from the add through the scaling (blockDim.x = hidden / 8 rounded up to a warp).
// With moe.expert_rows set (and delta null), the delta is the MoE combine of row r: sum over its top-k entries
// in router order of weight * expert row, fp32 FMAs (launch_moe_combine_add_rms_norm).
__global__ void __launch_bounds__(1024)
    add_rms_norm_vector_kernel(float* residual, const float* delta, const uint16_t* weight, float eps,
                               const int32_t* rows, int hidden, uint16_t* out, MoeCombineDelta moe) {
  wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  __shared__ double scratch[32];
  const int64_t i = blockIdx.x;
  const int64_t r = rows ? rows[i] : i;
  const int v = threadIdx.x;
  const bool active = v < hidden / 8;
  float x[8], w[8];
  double sum_sq = 0;
  if (active) {
    unpack8(reinterpret_cast<const uint4*>(weight)[v], w);  // issued early: its latency hides behind the sum
    float4* res = reinterpret_cast<float4*>(residual + r * hidden) + 2 * v;
    float4 lo = res[0], hi = res[1];
    if (delta) {
      const float4* d = reinterpret_cast<const float4*>(delta + r * hidden) + 2 * v;
      lo = add4(lo, d[0]);
      hi = add4(hi, d[1]);
      res[0] = lo;
      res[1] = hi;
    } else if (moe.expert_rows) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int j = 0; j < moe.top_k; ++j) {
        const int64_t e = r * moe.top_k + j;
        const float wj = moe.weights[e];
        float f[8];
        unpack8(reinterpret_cast<const uint4*>(moe.expert_rows + static_cast<int64_t>(moe.entry_row[e]) * hidden)[v], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = __fmaf_rn(wj, f[q], acc[q]);
      }
      lo = add4(lo, make_float4(acc[0], acc[1], acc[2], acc[3]));
      hi = add4(hi, make_float4(acc[4], acc[5], acc[6], acc[7]));
      res[0] = lo;
      res[1] = hi;
    }
    x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w, x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
#pragma unroll
    for (int k = 0; k < 8; ++k) sum_sq += static_cast<double>(x[k]) * x[k];  // exact product: FMA or not, same
  }
  sum_sq = cuda::block_sum(sum_sq, scratch);  // every thread takes part (it synchronizes the block)
  if (!active) return;
  const float inv_rms = inv_rms_of(sum_sq, hidden, eps);
  uint4 packed;
  packed.x = pack2(norm_scale(w[0], x[0], inv_rms), norm_scale(w[1], x[1], inv_rms));
  packed.y = pack2(norm_scale(w[2], x[2], inv_rms), norm_scale(w[3], x[3], inv_rms));
  packed.z = pack2(norm_scale(w[4], x[4], inv_rms), norm_scale(w[5], x[5], inv_rms));
  packed.w = pack2(norm_scale(w[6], x[6], inv_rms), norm_scale(w[7], x[7], inv_rms));
  reinterpret_cast<uint4*>(out + i * hidden)[v] = packed;
}

// Any hidden size or alignment: block-stride loops; the second pass re-reads the values this thread wrote.
__global__ void add_rms_norm_scalar_kernel(float* residual, const float* delta, const uint16_t* weight, float eps,
                                           const int32_t* rows, int hidden, uint16_t* out) {
  wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  __shared__ double scratch[32];
  const int64_t i = blockIdx.x;
  const int64_t r = rows ? rows[i] : i;
  float* x = residual + r * hidden;  // [H]
  double sum_sq = 0;
  for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
    float value = x[j];
    if (delta) {
      value = __fadd_rn(value, delta[r * hidden + j]);
      x[j] = value;
    }
    sum_sq += static_cast<double>(value) * value;
  }
  sum_sq = cuda::block_sum(sum_sq, scratch);
  const float inv_rms = inv_rms_of(sum_sq, hidden, eps);
  uint16_t* o = out + i * hidden;
  for (int j = threadIdx.x; j < hidden; j += blockDim.x)
    o[j] = f32_to_bf16(norm_scale(bf16_to_f32(weight[j]), x[j], inv_rms));
}

// ---- q/k norm + RoPE + KV append. Block = kQkWarps heads of one token (blocks head_blocks * t + hb); heads are
// numbered as in the qkv row: q [0, Hq), k [Hq, Hq + Hkv), v [Hq + Hkv, Hq + 2 Hkv). The block first puts the
// token's cos / sin [D / 2] in shared memory; then lane l of a head's warp holds the rotation pairs
// (i, i + D / 2) for i = l + 32 p < D / 2, p < kPairs.
template <int kPairs>
__global__ void __launch_bounds__(kQkWarps * 32)
    qk_norm_rope_kv_append_kernel(const float* qkv, const uint16_t* q_norm, const uint16_t* k_norm, float eps,
                                  const int32_t* positions, const float* inv_freq, const int32_t* kv_rows,
                                  int num_heads, int num_kv_heads, int head_dim, int head_blocks, uint16_t* q_out,
                                  uint16_t* k_pool, uint16_t* v_pool) {
  wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  __shared__ float s_cos[kPairs * 32], s_sin[kPairs * 32];
  const int64_t t = blockIdx.x / head_blocks;
  const int head = static_cast<int>(blockIdx.x % head_blocks) * kQkWarps + static_cast<int>(threadIdx.x) / 32;
  const int lane = threadIdx.x % 32, half = head_dim / 2;
  const int num_row_heads = num_heads + 2 * num_kv_heads;
  const float position = static_cast<float>(positions[t]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float angle = __fmul_rn(position, inv_freq[i]);
    s_cos[i] = cosf(angle);  // the precise functions (within 2 ulp of the CPU's), not __cosf / __sinf
    s_sin[i] = sinf(angle);
  }
  __syncthreads();
  // Below, every branch is uniform over a warp (one head, one token), so the warp reductions see all lanes.
  if (head >= num_row_heads) return;
  const bool is_q = head < num_heads, is_v = head >= num_heads + num_kv_heads;
  const int32_t kv_row = kv_rows[t];
  if (!is_q && kv_row < 0) return;  // a padding token: q only

  const float* src = qkv + t * num_row_heads * head_dim + static_cast<int64_t>(head) * head_dim;  // [D]
  float a[kPairs], b[kPairs];
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    const int i = lane + 32 * p;
    a[p] = i < half ? src[i] : 0.0f;
    b[p] = i < half ? src[i + half] : 0.0f;
  }
  uint16_t* dst;  // [D]
  if (is_q) {
    dst = q_out + (t * num_heads + head) * head_dim;
  } else {
    const int kv_head = is_v ? head - num_heads - num_kv_heads : head - num_heads;
    dst = (is_v ? v_pool : k_pool) + (static_cast<int64_t>(kv_row) * num_kv_heads + kv_head) * head_dim;
  }
  if (is_v) {
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      const int i = lane + 32 * p;
      if (i < half) {
        dst[i] = f32_to_bf16(a[p]);
        dst[i + half] = f32_to_bf16(b[p]);
      }
    }
    return;
  }
  double sum_sq = 0;
#pragma unroll
  for (int p = 0; p < kPairs; ++p) sum_sq += static_cast<double>(a[p]) * a[p] + static_cast<double>(b[p]) * b[p];
  const float inv_rms = inv_rms_of(cuda::warp_sum(sum_sq), head_dim, eps);
  const uint16_t* weight = is_q ? q_norm : k_norm;  // [D]
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    const int i = lane + 32 * p;
    if (i >= half) continue;
    const float na = norm_scale(bf16_to_f32(weight[i]), a[p], inv_rms);
    const float nb = norm_scale(bf16_to_f32(weight[i + half]), b[p], inv_rms);
    const float c = s_cos[i], s = s_sin[i];
    dst[i] = f32_to_bf16(__fsub_rn(__fmul_rn(na, c), __fmul_rn(nb, s)));
    dst[i + half] = f32_to_bf16(__fadd_rn(__fmul_rn(nb, c), __fmul_rn(na, s)));
  }
}

// ---- SwiGLU: grid-stride over the outputs, 4 per step on the vector path (two 16-byte loads, one 8-byte store).
__device__ __forceinline__ float silu_times(float gate, float up) {
  return __fmul_rn(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate))), up);  // expf, not __expf
}

template <bool kVector>
__global__ void silu_mul_kernel(const float* gate_up, int64_t num_rows, int width, uint16_t* act) {
  wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  const int per_row = kVector ? width / 4 : width;
  const int64_t n = num_rows * per_row;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n; idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = idx / per_row;
    const int c = static_cast<int>(idx % per_row);
    const float* g = gate_up + r * 2 * width;  // [2I]: gate | up
    if constexpr (kVector) {
      const float4 gate = reinterpret_cast<const float4*>(g)[c];
      const float4 up = reinterpret_cast<const float4*>(g + width)[c];
      uint2 packed;
      packed.x = pack2(silu_times(gate.x, up.x), silu_times(gate.y, up.y));
      packed.y = pack2(silu_times(gate.z, up.z), silu_times(gate.w, up.w));
      reinterpret_cast<uint2*>(act + r * width)[c] = packed;
    } else {
      act[r * width + c] = f32_to_bf16(silu_times(g[c], g[width + c]));
    }
  }
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
unsigned int warps_for(int64_t threads) {
  const int64_t rounded = (threads + 31) / 32 * 32;
  return static_cast<unsigned int>(rounded < 32 ? 32 : rounded);
}

}  // namespace

cudaError_t launch_embedding(const uint16_t* table, const int32_t* token_ids, int64_t num_tokens, int hidden,
                             float* residual, cudaStream_t stream) {
  if (num_tokens < 0 || hidden < 0) return cudaErrorInvalidValue;
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned int>(num_tokens);
  if (hidden % 8 == 0 && aligned(table, 16) && aligned(residual, 16)) {
    const unsigned int threads = std::min(warps_for(hidden / 8), 256u);
    return launch_dependent(embedding_kernel<true>, dim3(blocks), dim3(threads), 0, stream, table, token_ids, hidden,
                            residual);
  }
  const unsigned int threads = std::min(warps_for(hidden), 256u);
  return launch_dependent(embedding_kernel<false>, dim3(blocks), dim3(threads), 0, stream, table, token_ids, hidden,
                          residual);
}

cudaError_t launch_add_rms_norm(float* residual, const float* delta, const uint16_t* weight, float eps,
                                const int32_t* rows, int64_t num_out_rows, int hidden, uint16_t* out,
                                cudaStream_t stream) {
  if (num_out_rows < 0 || hidden < 0) return cudaErrorInvalidValue;
  if (num_out_rows == 0 || hidden == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned int>(num_out_rows);
  const bool vector = hidden % 8 == 0 && hidden <= kMaxVectorHidden && aligned(residual, 16) &&
                      (delta == nullptr || aligned(delta, 16)) && aligned(weight, 16) && aligned(out, 16);
  if (vector) {
    return launch_dependent(add_rms_norm_vector_kernel, dim3(blocks), dim3(warps_for(hidden / 8)), 0, stream, residual,
                            delta, weight, eps, rows, hidden, out, MoeCombineDelta{});
  }
  return launch_dependent(add_rms_norm_scalar_kernel, dim3(blocks), dim3(kScalarThreads), 0, stream, residual, delta,
                          weight, eps, rows, hidden, out);
}

bool moe_combine_add_rms_norm_supported(int hidden) { return hidden > 0 && hidden % 8 == 0 && hidden <= kMaxVectorHidden; }

cudaError_t launch_moe_combine_add_rms_norm(float* residual, const MoeCombineDelta& moe, const uint16_t* weight,
                                            float eps, const int32_t* rows, int64_t num_out_rows, int hidden,
                                            uint16_t* out, cudaStream_t stream) {
  if (num_out_rows < 0 || !moe_combine_add_rms_norm_supported(hidden) || moe.expert_rows == nullptr ||
      moe.entry_row == nullptr || moe.weights == nullptr || moe.top_k < 1) {
    return cudaErrorInvalidValue;
  }
  if (!aligned(residual, 16) || !aligned(moe.expert_rows, 16) || !aligned(weight, 16) || !aligned(out, 16)) {
    return cudaErrorInvalidValue;
  }
  if (num_out_rows == 0) return cudaSuccess;
  return launch_dependent(add_rms_norm_vector_kernel, dim3(static_cast<unsigned int>(num_out_rows)),
                          dim3(warps_for(hidden / 8)), 0, stream, residual, static_cast<const float*>(nullptr), weight,
                          eps, rows, hidden, out, moe);
}

cudaError_t launch_qk_norm_rope_kv_append(const float* qkv, const uint16_t* q_norm, const uint16_t* k_norm, float eps,
                                          const int32_t* positions, const float* inv_freq, const int32_t* kv_rows,
                                          int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim,
                                          uint16_t* q_out, uint16_t* k_pool, uint16_t* v_pool, cudaStream_t stream) {
  if (num_tokens < 0 || num_heads < 0 || num_kv_heads < 0 || !step_ops_supports_head_dim(head_dim)) {
    return cudaErrorInvalidValue;
  }
  const int num_row_heads = num_heads + 2 * num_kv_heads;
  if (num_tokens == 0 || num_row_heads == 0) return cudaSuccess;
  const int head_blocks = (num_row_heads + kQkWarps - 1) / kQkWarps;
  if (num_tokens * head_blocks > 0x7fffffff) return cudaErrorInvalidValue;  // the grid's x limit
  const auto blocks = static_cast<unsigned int>(num_tokens * head_blocks);
  const unsigned int threads = kQkWarps * 32;
  const auto kernel = head_dim <= 64    ? qk_norm_rope_kv_append_kernel<1>
                      : head_dim == 128 ? qk_norm_rope_kv_append_kernel<2>
                                        : qk_norm_rope_kv_append_kernel<4>;
  return launch_dependent(kernel, dim3(blocks), dim3(threads), 0, stream, qkv, q_norm, k_norm, eps, positions, inv_freq,
                          kv_rows, num_heads, num_kv_heads, head_dim, head_blocks, q_out, k_pool, v_pool);
}

cudaError_t launch_silu_mul(const float* gate_up, int64_t num_rows, int width, uint16_t* act, cudaStream_t stream) {
  if (num_rows < 0 || width < 0) return cudaErrorInvalidValue;
  if (num_rows == 0 || width == 0) return cudaSuccess;
  if (width % 4 == 0 && aligned(gate_up, 16) && aligned(act, 8)) {
    return launch_dependent(silu_mul_kernel<true>, dim3(cuda::grid_for(num_rows * (width / 4))),
                            dim3(cuda::kThreadsPerBlock), 0, stream, gate_up, num_rows, width, act);
  }
  return launch_dependent(silu_mul_kernel<false>, dim3(cuda::grid_for(num_rows * width)), dim3(cuda::kThreadsPerBlock), 0,
                          stream, gate_up, num_rows, width, act);
}

}  // namespace fulcrum::gpu
