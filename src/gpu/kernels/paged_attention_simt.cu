// CUDA-core paged attention for every head_dim (16..256): the fallback of the tensor-core kernels and the path of
// head_dim 16 / 32 / 256. Same work split as paged_attention_mma.cu (decode: the group's q heads as one 16-row
// tile; prefill: tiles of 16 rows), everything in fp32 (P is not rounded).
//
// A CTA (4 warps) holds 16 query rows in shared memory (fp32) and walks its key range in tiles of 32 positions:
// K and V rows staged in shared memory (row stride D + 2 bf16, so 32 lanes reading one 4-byte word of 32
// different rows hit 32 different banks). Warp w owns rows 4w .. 4w + 3: lane j scores key j against its 4 rows
// (one K load serves 4 rows), the warp's max and exponentials give P (shared, warp-private rows), then lane j
// accumulates d = j + 32 c of its 4 rows over the tile's keys in order.
#include <cuda_bf16.h>

#include "gpu/kernels/dependent_launch.cuh"

#include "gpu/kernels/paged_attention_work.cuh"

namespace fulcrum::gpu::attention {
namespace {

constexpr int kRows = 16;  // = PagedAttentionPlan::prefill_rows of this path
constexpr int kKeys = 32;
constexpr int kRowsPerWarp = kRows / (kThreads / 32);

template <int D>
struct SimtConfig {
  static constexpr int kStride = D + 2;             // bf16 row stride of the K / V tiles
  static constexpr int kLaneD = (D + 31) / 32;      // output columns per lane
  static constexpr size_t kSmemBytes = sizeof(float) * (kRows * D + kRows * kKeys) +
                                       sizeof(uint16_t) * 2 * kKeys * kStride;
};

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <int D, bool kDecode>
__global__ void __launch_bounds__(kThreads) simt_attention_kernel(const Params p) {
  wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  using Cfg = SimtConfig<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int scratch[kThreads / 32 + 2];
  const WorkItem w = find_work<kDecode>(p, scratch);
  if (!w.valid) return;

  float* const q_s = reinterpret_cast<float*>(smem);                // [kRows][D]
  float* const p_s = q_s + kRows * D;                               // [kRows][kKeys]
  uint16_t* const k_s = reinterpret_cast<uint16_t*>(p_s + kRows * kKeys);  // [kKeys][kStride]
  uint16_t* const v_s = k_s + kKeys * Cfg::kStride;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int H = p.num_heads, G = p.group;

  for (int idx = tid; idx < kRows * D; idx += kThreads) {
    const int r = idx / D, d = idx % D, R = w.row_begin + r;
    q_s[idx] = R < w.row_end ? bf16_to_f32(p.q[(row_token(w, R, G) * H + row_head(w, R, G)) * D + d]) : 0.0f;
  }
  int last[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int R = w.row_begin + warp * kRowsPerWarp + rr;
    last[rr] = R < w.row_end ? w.kv_len - w.n + R / G : 0x7fffffff;  // padding rows: finite, never stored
  }

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][Cfg::kLaneD];  // l: this lane's keys only
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.0f;
#pragma unroll
    for (int c = 0; c < Cfg::kLaneD; ++c) acc[rr][c] = 0.0f;
  }

  const int64_t pool_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  const int64_t head_offset = static_cast<int64_t>(w.kv_head) * D;
  for (int k0 = w.key_begin; k0 < w.key_end; k0 += kKeys) {
    // Stage K / V: 16-byte chunks, positions past the range as zeros.
    for (int c = tid; c < kKeys * (D / 8); c += kThreads) {
      const int key = c / (D / 8), chunk = c % (D / 8), pos = k0 + key;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (pos < w.key_end) {
        const int64_t at = pool_row(p, w, pos) * pool_stride + head_offset + chunk * 8;
        kv = *reinterpret_cast<const uint4*>(p.k_pool + at);
        vv = *reinterpret_cast<const uint4*>(p.v_pool + at);
      }
      uint32_t* kd = reinterpret_cast<uint32_t*>(k_s + key * Cfg::kStride + chunk * 8);
      uint32_t* vd = reinterpret_cast<uint32_t*>(v_s + key * Cfg::kStride + chunk * 8);
      kd[0] = kv.x, kd[1] = kv.y, kd[2] = kv.z, kd[3] = kv.w;
      vd[0] = vv.x, vd[1] = vv.y, vd[2] = vv.z, vd[3] = vv.w;
    }
    __syncthreads();

    // Scores of key `lane` against the warp's rows.
    float s[kRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) s[rr] = 0.0f;
    const uint32_t* k_row = reinterpret_cast<const uint32_t*>(k_s + lane * Cfg::kStride);
    const float* q_rows = q_s + warp * kRowsPerWarp * D;
#pragma unroll 4
    for (int dp = 0; dp < D / 2; ++dp) {
      const uint32_t pair = k_row[dp];
      const float k_lo = bf16_lo(pair), k_hi = bf16_hi(pair);
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const float2 qv = *reinterpret_cast<const float2*>(q_rows + rr * D + 2 * dp);
        s[rr] = fmaf(qv.x, k_lo, s[rr]);
        s[rr] = fmaf(qv.y, k_hi, s[rr]);
      }
    }

    // Online softmax per row (log2 domain); P of the tile to shared memory.
    const int pos = k0 + lane;
    float* const p_rows = p_s + warp * kRowsPerWarp * kKeys;
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const float x = (pos < w.key_end && pos <= last[rr]) ? s[rr] * p.scale_log2 : -INFINITY;
      const float m_new = fmaxf(m[rr], warp_max(x));
      const float base = m_new == -INFINITY ? 0.0f : m_new;  // no key yet: avoids inf - inf
      const float alpha = exp2f(m[rr] - base);
      m[rr] = m_new;
      const float pr = exp2f(x - base);
      l[rr] = l[rr] * alpha + pr;
      p_rows[rr * kKeys + lane] = pr;
#pragma unroll
      for (int c = 0; c < Cfg::kLaneD; ++c) acc[rr][c] *= alpha;
    }
    __syncwarp();

    // acc += P V over the tile's keys in order.
    for (int j = 0; j < kKeys; ++j) {
      float pj[kRowsPerWarp];
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) pj[rr] = p_rows[rr * kKeys + j];
#pragma unroll
      for (int c = 0; c < Cfg::kLaneD; ++c) {
        const int d = lane + 32 * c;
        if (D % 32 == 0 || d < D) {
          const float v = bf16_to_f32(v_s[j * Cfg::kStride + d]);
#pragma unroll
          for (int rr = 0; rr < kRowsPerWarp; ++rr) acc[rr][c] = fmaf(pj[rr], v, acc[rr][c]);
        }
      }
    }
    __syncthreads();  // the tiles (and P) are rewritten next
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const float l_all = warp_sum(l[rr]);
    const int R = w.row_begin + warp * kRowsPerWarp + rr;
    if (R >= w.row_end) continue;
    const float inv = l_all > 0.0f ? 1.0f / l_all : 0.0f;
    if (w.num_splits == 1) {
      uint16_t* dst = p.out + (row_token(w, R, G) * H + row_head(w, R, G)) * D;
#pragma unroll
      for (int c = 0; c < Cfg::kLaneD; ++c) {
        const int d = lane + 32 * c;
        if (D % 32 == 0 || d < D) dst[d] = f32_to_bf16(acc[rr][c] * inv);
      }
    } else {
      const int64_t slot = partial_slot(w, R, G, H);
#pragma unroll
      for (int c = 0; c < Cfg::kLaneD; ++c) {
        const int d = lane + 32 * c;
        if (D % 32 == 0 || d < D) w.part_o[slot * D + d] = acc[rr][c] * inv;
      }
      if (lane == 0) w.part_lse[slot] = l_all > 0.0f ? m[rr] + log2f(l_all) : -INFINITY;
    }
  }
  if constexpr (kDecode) {
    if (w.num_splits > 1) {
      __shared__ float merge_weights[kThreads / 32][kPagedAttentionMaxSplits];
      finish_decode_splits(p, w, D, merge_weights);
    }
  }
}

template <int D, bool kDecode>
cudaError_t launch_simt(const Params& p, dim3 grid, cudaStream_t stream) {
  constexpr size_t kSmem = SimtConfig<D>::kSmemBytes;
  if constexpr (kSmem > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(simt_attention_kernel<D, kDecode>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem));
    if (status != cudaSuccess) return status;
  }
  return launch_dependent(simt_attention_kernel<D, kDecode>, grid, dim3(kThreads), kSmem, stream, p);
}

template <bool kDecode>
cudaError_t launch_simt_flavor(const Params& p, int head_dim, dim3 grid, cudaStream_t stream) {
  switch (head_dim) {
    case 16: return launch_simt<16, kDecode>(p, grid, stream);
    case 32: return launch_simt<32, kDecode>(p, grid, stream);
    case 64: return launch_simt<64, kDecode>(p, grid, stream);
    case 128: return launch_simt<128, kDecode>(p, grid, stream);
    case 256: return launch_simt<256, kDecode>(p, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_simt_attention(const Params& p, int head_dim, bool decode, dim3 grid, cudaStream_t stream) {
  return decode ? launch_simt_flavor<true>(p, head_dim, grid, stream) : launch_simt_flavor<false>(p, head_dim, grid, stream);
}

}  // namespace fulcrum::gpu::attention
