#pragma once
// What the paged attention kernels share (paged_attention.cu, _mma.cu, _simt.cu): the kernel parameters, how a
// CTA finds its work (sequence, query rows, key range of its split) from device memory, where split partials
// go, and the small device helpers. Internal to those files.
//
// Rows: sequence s with n new tokens and group G = num_heads / num_kv_heads has n * G query rows per kv head;
// row R is token i = R / G (position kv_len - n + i) of head kvh * G + R % G. A tile is rows
// [tile * rows_per_tile, ...) (rows_per_tile a multiple of G, so a token's heads never straddle two tiles).
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gpu/kernels/paged_attention.hpp"

namespace fulcrum::gpu::attention {

constexpr int kThreads = 128;  // every attention CTA: 4 warps

struct Params {
  const uint16_t* q;         // [T, H, D] bf16
  uint16_t* out;             // [T, H, D] bf16
  const uint16_t* k_pool;    // [rows, Hkv, D] bf16
  const uint16_t* v_pool;
  const int32_t* q_indptr;   // [S + 1]
  const int32_t* kv_page_indptr;
  const int32_t* page_ids;
  const int32_t* kv_len;     // [S]
  int num_seqs, num_heads, num_kv_heads, group, page_size;
  float scale_log2;          // sm_scale * log2(e): scores in the log2 domain, exp2 below
  // Split partials: decode [S][decode_splits][H][D] fp32 + lse [S][decode_splits][H]; prefill the same per
  // token [T][prefill_splits][H]. lse is m + log2(l) of the split's rows (log2 domain), -inf without keys.
  float* decode_o;
  float* decode_lse;
  int decode_splits;
  int32_t* split_counters;   // [S][Hkv]: finished decode splits (AttentionBatch::split_counters)
  int decode_cluster;        // > 1: the decode_splits CTAs of a (sequence, kv head) are one cluster, merged in DSMEM
  int decode_stages;         // K / V stages of the decode kernel (PagedAttentionPlan::decode_stages)
  bool early_kv;             // decode: cached K / V tiles and page ids read before the wait (PagedAttentionPlan)
  float* prefill_o;
  float* prefill_lse;
  int prefill_splits;
  int prefill_rows;          // rows per prefill tile
};

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// How a row range's keys [0, keys) are cut: splits of `chunk` positions (a multiple of
// kPagedAttentionSplitAlign), the last one shorter. Depends on keys and max_splits only.
struct KeySplits {
  int count, chunk;
};
__device__ __forceinline__ KeySplits split_keys(int keys, int max_splits) {
  if (keys <= 0) return {0, kPagedAttentionSplitAlign};
  const int chunk = ceil_div(ceil_div(keys, max_splits), kPagedAttentionSplitAlign) * kPagedAttentionSplitAlign;
  return {ceil_div(keys, chunk), chunk};
}

__device__ __forceinline__ int prefill_tiles_of(int n, int group, int rows_per_tile) {
  return n >= 2 ? ceil_div(n * group, rows_per_tile) : 0;
}

// One CTA's work: rows [row_begin, row_end) of sequence `seq` for kv head `kv_head`, keys
// [key_begin, key_end) (split `split` of `num_splits`).
struct WorkItem {
  bool valid;
  int seq, q_begin, n, kv_len, kv_head;
  int page_begin;   // kv_page_indptr[seq]
  int row_begin, row_end;
  int key_begin, key_end;
  int split, num_splits;
  float* part_o;    // partial base for token i of the rows: [(part_index + i) * max_splits + split][H][D]
  float* part_lse;
  int part_index;   // decode: seq; prefill: q_begin
  int max_splits;
};

__device__ __forceinline__ void finish_item(WorkItem& w, int keys_needed, int max_splits) {
  const KeySplits sp = split_keys(keys_needed, max_splits);
  w.split = static_cast<int>(blockIdx.z);
  w.num_splits = sp.count;
  w.max_splits = max_splits;
  w.valid = w.split < sp.count;
  w.key_begin = w.split * sp.chunk;
  w.key_end = min(keys_needed, w.key_begin + sp.chunk);
}

// Decode launch: grid (S, Hkv, decode_splits); the CTA's sequence is blockIdx.x, work only when n_s == 1.
__device__ __forceinline__ WorkItem decode_work(const Params& p) {
  WorkItem w{};
  w.seq = static_cast<int>(blockIdx.x);
  w.kv_head = static_cast<int>(blockIdx.y);
  w.q_begin = p.q_indptr[w.seq];
  w.n = p.q_indptr[w.seq + 1] - w.q_begin;
  w.kv_len = p.kv_len[w.seq];
  w.page_begin = p.kv_page_indptr[w.seq];
  w.valid = false;
  if (w.n != 1) return w;
  w.row_begin = 0;
  w.row_end = p.group;
  w.part_o = p.decode_o;
  w.part_lse = p.decode_lse;
  w.part_index = w.seq;
  finish_item(w, w.kv_len, p.decode_splits);
  return w;
}

// Prefill launch: grid (prefill_tiles, Hkv, prefill_splits); blockIdx.x is a tile of the batch's prefill
// tiles in sequence order (within a sequence, from its last tile: causal work grows with the tile). The block finds it: each thread sums the tiles of ceil(S / kThreads) consecutive
// sequences (independent loads), a block scan, and the thread whose range holds the tile walks it.
// Every thread of the block must call this (it synchronizes); `scratch` is __shared__ int[kThreads / 32 + 2].
__device__ inline WorkItem prefill_work(const Params& p, int* scratch) {
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int target = static_cast<int>(blockIdx.x);
  const int per_thread = ceil_div(p.num_seqs, kThreads);
  const int s_begin = min(p.num_seqs, tid * per_thread), s_end = min(p.num_seqs, s_begin + per_thread);
  int mine = 0;
  for (int s = s_begin; s < s_end; ++s) mine += prefill_tiles_of(p.q_indptr[s + 1] - p.q_indptr[s], p.group, p.prefill_rows);
  int inclusive = mine;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (tid == 0) {
    scratch[kThreads / 32] = -1;  // the sequence found
    scratch[kThreads / 32 + 1] = 0;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  int before = inclusive - mine;
  for (int w = 0; w < warp; ++w) before += scratch[w];
  if (target >= before && target < before + mine) {
    for (int s = s_begin; s < s_end; ++s) {
      const int tiles = prefill_tiles_of(p.q_indptr[s + 1] - p.q_indptr[s], p.group, p.prefill_rows);
      if (target < before + tiles) {
        scratch[kThreads / 32] = s;
        scratch[kThreads / 32 + 1] = tiles - 1 - (target - before);  // last tiles first: they see the most keys
        break;
      }
      before += tiles;
    }
  }
  __syncthreads();
  WorkItem w{};
  w.valid = false;
  w.seq = scratch[kThreads / 32];
  const int tile = scratch[kThreads / 32 + 1];
  if (w.seq < 0) return w;
  w.kv_head = static_cast<int>(blockIdx.y);
  w.q_begin = p.q_indptr[w.seq];
  w.n = p.q_indptr[w.seq + 1] - w.q_begin;
  w.kv_len = p.kv_len[w.seq];
  w.page_begin = p.kv_page_indptr[w.seq];
  w.row_begin = tile * p.prefill_rows;
  w.row_end = min(w.n * p.group, w.row_begin + p.prefill_rows);
  w.part_o = p.prefill_o;
  w.part_lse = p.prefill_lse;
  w.part_index = w.q_begin;
  const int last_token = (w.row_end - 1) / p.group;
  finish_item(w, w.kv_len - w.n + last_token + 1, p.prefill_splits);
  return w;
}

// Pool row of position `pos` of the item's sequence.
__device__ __forceinline__ int64_t pool_row(const Params& p, const WorkItem& w, int pos) {
  const int page = __ldg(p.page_ids + w.page_begin + pos / p.page_size);
  return static_cast<int64_t>(page) * p.page_size + pos % p.page_size;
}

__device__ __forceinline__ float bf16_lo(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t pair) { return __uint_as_float(pair & 0xffff0000u); }
__device__ __forceinline__ float bf16_to_f32(uint16_t bits) { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }
__device__ __forceinline__ uint16_t f32_to_bf16(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return static_cast<uint32_t>(f32_to_bf16(lo)) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
}

// Where row R of the item writes: its token, its head. The partial of (token, head) is
// part_o[((part_index + i) * max_splits + split) * H + head][D].
__device__ __forceinline__ int64_t row_token(const WorkItem& w, int R, int group) { return w.q_begin + R / group; }
__device__ __forceinline__ int row_head(const WorkItem& w, int R, int group) { return w.kv_head * group + R % group; }
__device__ __forceinline__ int64_t partial_slot(const WorkItem& w, int R, int group, int num_heads) {
  return (static_cast<int64_t>(w.part_index + R / group) * w.max_splits + w.split) * num_heads + row_head(w, R, group);
}

// Merges the split partials of one (token, head): weights exp2(lse_z - max) in split order, so the result does
// not depend on which CTA merges or when. One warp; `weights` is shared scratch of kPagedAttentionMaxSplits
// floats for this warp. Partials are read through L2 (__ldcg): other CTAs wrote them during this launch.
__device__ inline void merge_head_splits(const float* part_o, const float* part_lse, int64_t first, int H, int D,
                                         int splits, float* weights, uint16_t* dst) {
  static_assert(kPagedAttentionMaxSplits == 64, "two splits per lane");
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const float lse_lo = lane < splits ? __ldcg(part_lse + first + static_cast<int64_t>(lane) * H) : -INFINITY;
  const float lse_hi = lane + 32 < splits ? __ldcg(part_lse + first + static_cast<int64_t>(lane + 32) * H) : -INFINITY;
  float max_lse = fmaxf(lse_lo, lse_hi);
  for (int offset = 16; offset > 0; offset /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, offset));
  const float base = max_lse == -INFINITY ? 0.0f : max_lse;
  const float w_lo = exp2f(lse_lo - base), w_hi = exp2f(lse_hi - base);
  float total = w_lo + w_hi;
  for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
  weights[lane] = w_lo;
  weights[lane + 32] = w_hi;
  __syncwarp();
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  // Lane l owns d = l + 32 c (c < 8: D <= 256); the loads of one split are independent of each other.
  constexpr int kMaxPerLane = 8;
  float acc[kMaxPerLane];
#pragma unroll
  for (int c = 0; c < kMaxPerLane; ++c) acc[c] = 0.0f;
#pragma unroll 4  // the loads of 4 splits in flight; the adds keep split order
  for (int z = 0; z < splits; ++z) {
    const float wz = weights[z];
    const float* src = part_o + (first + static_cast<int64_t>(z) * H) * D;
#pragma unroll
    for (int c = 0; c < kMaxPerLane; ++c) {
      const int d = lane + 32 * c;
      if (d < D) acc[c] += wz * __ldcg(src + d);
    }
  }
#pragma unroll
  for (int c = 0; c < kMaxPerLane; ++c) {
    const int d = lane + 32 * c;
    if (d < D) dst[d] = f32_to_bf16(acc[c] * inv);
  }
  __syncwarp();  // weights is reused by the warp's next head
}

// End of a decode CTA that wrote split partials: the last of its (sequence, kv head)'s splits to finish merges
// the group's heads (one warp per head) and resets the counter for the next launch. Every thread of the CTA
// calls it. `weights` is shared scratch [kThreads / 32][kPagedAttentionMaxSplits].
__device__ inline void finish_decode_splits(const Params& p, const WorkItem& w, int D, float (*weights)[kPagedAttentionMaxSplits]) {
  __shared__ int is_last;
  __threadfence();  // this CTA's partials are visible to the CTA that merges
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* counter = p.split_counters + static_cast<int64_t>(w.seq) * p.num_kv_heads + w.kv_head;
    const int finished = atomicAdd(counter, 1) + 1;
    is_last = finished == w.num_splits;
    if (is_last) atomicExch(counter, 0);
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int warp = static_cast<int>(threadIdx.x) / 32, H = p.num_heads;
  for (int r = warp; r < p.group; r += kThreads / 32) {
    const int h = w.kv_head * p.group + r;
    const int64_t first = static_cast<int64_t>(w.seq) * w.max_splits * H + h;
    merge_head_splits(w.part_o, w.part_lse, first, H, D, w.num_splits, weights[warp],
                      p.out + (static_cast<int64_t>(w.q_begin) * H + h) * D);
  }
}

template <bool kDecode>
__device__ __forceinline__ WorkItem find_work(const Params& p, int* scratch) {
  if constexpr (kDecode) {
    return decode_work(p);
  } else {
    return prefill_work(p, scratch);
  }
}

// Launchers of the kernel families (one per file). `decode` picks the decode or the prefill launch's grid.
cudaError_t launch_mma_attention(const Params& p, int head_dim, bool decode, dim3 grid, cudaStream_t stream);
cudaError_t launch_simt_attention(const Params& p, int head_dim, bool decode, dim3 grid, cudaStream_t stream);

}  // namespace fulcrum::gpu::attention
