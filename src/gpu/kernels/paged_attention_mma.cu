// Tensor-core paged attention (head_dim 64 and 128), FlashAttention-2 style on mma.sync m16n8k16 bf16 -> fp32.
// See paged_attention.hpp for the work split and paged_attention_work.cuh for the row / split bookkeeping.
//
// A CTA (4 warps) holds up to 16 * kWarpsM query rows of one kv head and walks its key range in tiles of 64
// positions, K and V staged in shared memory by cp.async (16-byte copies, positions past the range zero-filled; two
// stages for prefill, two to four for decode: PagedAttentionPlan::decode_stages) and read by ldmatrix from an
// XOR-swizzled layout (16-byte chunk c of key k at c ^ (k % 8): no bank conflicts). Each warp owns 16 rows; Q stays
// in registers as mma A fragments, S = Q K^T in fp32 accumulators, online softmax in the log2 domain, P rounded to
// bf16 becomes the A fragment of O += P V (the row sum l adds the rounded values, so O / l is a weighted mean with
// the weights actually used).
//   prefill: kWarpsM = 4 (64 rows), every warp takes the whole 64-key tile;
//   decode:  kWarpsM = 1 (the group's q heads, <= 16 rows), the 4 warps take 16 keys each of every tile and
//            their (m, l, O) are merged through shared memory at the end, warps in order; with KV splits either
//            the splits of a (sequence, kv head) form one thread block cluster and each CTA merges some of the
//            rows from its peers' shared memory (kCluster), or the last split's CTA merges them from the workspace
//            (finish_decode_splits). With p.early_kv a decode CTA finds its work, reads the page ids and starts
//            the copies of its first tiles before griddepcontrol.wait: none of that is written by this step's
//            earlier kernels (the step's inputs were copied before its first kernel, and every position below
//            kv_len - 1 was appended by an earlier step); Q and the new key's K / V row are read after it.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "gpu/kernels/paged_attention_ptx.cuh"
#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/paged_attention_work.cuh"

namespace fulcrum::gpu::attention {
namespace {

constexpr int kTileKeys = 64;

template <int D, bool kDecode, int kPipeStages, bool kCluster = false>
struct MmaConfig {
  static constexpr int kWarpsM = kDecode ? 1 : 4;
  static constexpr int kWarpsN = kDecode ? 4 : 1;
  static constexpr int kWarpKeys = kTileKeys / kWarpsN;  // 16 or 64
  static constexpr int kChunks = D / 8;                  // 16-byte chunks of a K / V row
  static constexpr int kStageElems = kTileKeys * D;      // bf16 of one K (or V) tile
  static constexpr int kOStride = D + 4;                 // fp32 row stride of the decode merge buffer
  static constexpr int kStages = kPipeStages;
  static constexpr size_t kPipeBytes = size_t{kStages} * 2 * kStageElems * sizeof(uint16_t);  // K and V stages
  static constexpr size_t kWarpMergeFloats = size_t{kWarpsN} * 16 * (kOStride + 2);  // m, l, O of each warp
  static constexpr size_t kClusterFloats = kCluster ? size_t{16} * (D + 1) : 0;         // the CTA's O rows, lse
  static constexpr size_t kMergeBytes = kDecode ? (kWarpMergeFloats + kClusterFloats) * sizeof(float) : 0;
  static constexpr size_t kSmemBytes = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
  static_assert(D == 64 || D == 128, "the swizzle needs >= 8 chunks per row; registers cap D at 128");
  static_assert(kWarpsM * kWarpsN * 32 == kThreads);
};

// Element offset of (key, 16-byte chunk) in a swizzled [kTileKeys][D] tile.
template <int D>
__device__ __forceinline__ int swizzled(int key, int chunk) {
  return key * D + ((chunk ^ (key & 7)) << 3);
}

template <int D, bool kDecode, int kStages, bool kCluster>
__global__ void __launch_bounds__(kThreads) mma_attention_kernel(const Params p) {
  static_assert(!kCluster || kDecode);
  namespace cg = cooperative_groups;
  const bool early = kDecode && p.early_kv;
  if (!early) wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  using Cfg = MmaConfig<D, kDecode, kStages, kCluster>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int scratch[kThreads / 32 + 2];
  const WorkItem w = find_work<kDecode>(p, scratch);
  // The CTAs of a cluster share one (sequence, kv head): all of them take part in its two cluster barriers when the
  // sequence decodes, those without keys too (their peers only wait for them).
  const bool in_cluster = kCluster && w.n == 1;
  if (!w.valid) {
    if (early) wait_then_release();
    if (in_cluster) {
      cg::this_cluster().sync();
      cg::this_cluster().sync();
    }
    return;
  }

  constexpr int S = Cfg::kStages;
  uint16_t* const k_tiles = reinterpret_cast<uint16_t*>(smem);  // [S][kTileKeys][D], swizzled
  uint16_t* const v_tiles = k_tiles + S * Cfg::kStageElems;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int warp_m = warp / Cfg::kWarpsN, warp_n = warp % Cfg::kWarpsN;
  const int g = lane / 4, tq = lane % 4;  // mma fragment coordinates: row group, thread in group
  const int H = p.num_heads, G = p.group;

  // This thread's two rows (fragment rows g and g + 8 of the warp's 16), their causal limit, their Q fragments.
  int row[2], last[2];
  bool row_ok[2];
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row[half] = w.row_begin + warp_m * 16 + g + 8 * half;
    row_ok[half] = row[half] < w.row_end;
    // Padding rows (Q = 0) keep every key of the range, so they stay finite; they are never stored.
    last[half] = row_ok[half] ? w.kv_len - w.n + row[half] / G : 0x7fffffff;
  }
  // K / V tile loader: thread tid copies chunk tid % kChunks of keys tid / kChunks + i * (kThreads / kChunks),
  // from the pool offsets that key_offset holds for the tile (-1: past the range, zero-filled).
  const int64_t pool_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  const uint16_t* const k_head = p.k_pool + static_cast<int64_t>(w.kv_head) * D;
  const uint16_t* const v_head = p.v_pool + static_cast<int64_t>(w.kv_head) * D;
  // `skip`: a key of the tile not copied (the new key, before the wait; -1: none).
  const auto load_tile = [&](int stage, const int64_t* offsets, int skip) {
    constexpr int kKeysPerPass = kThreads / Cfg::kChunks;
    const int chunk = tid % Cfg::kChunks;
#pragma unroll
    for (int pass = 0; pass < kTileKeys / kKeysPerPass; ++pass) {
      const int key = tid / Cfg::kChunks + pass * kKeysPerPass;
      if (key == skip) continue;
      const int64_t offset = offsets[key];
      const bool ok = offset >= 0;
      const int64_t at = (ok ? offset : 0) + chunk * 8;
      const int dst = stage * Cfg::kStageElems + swizzled<D>(key, chunk);
      cp_async_16(k_tiles + dst, k_head + at, ok);
      cp_async_16(v_tiles + dst, v_head + at, ok);
    }
  };
  // Pool offsets of tile t's keys live in key_offset[t % S]. Threads tid < 64 fetch the page ids of tile it + S
  // while tile it is computed and store the offsets after, so the copies of a tile never wait on the page table.
  __shared__ int64_t key_offset[S][kTileKeys];
  const int num_tiles = ceil_div(w.key_end - w.key_begin, kTileKeys);
  const auto offset_of = [&](int pos, int page) -> int64_t {
    return pos < w.key_end ? (static_cast<int64_t>(page) * p.page_size + pos % p.page_size) * pool_stride : -1;
  };
  const auto page_of = [&](int pos) { return pos < w.key_end ? __ldg(p.page_ids + w.page_begin + pos / p.page_size) : 0; };
  if (tid < kTileKeys) {
#pragma unroll
    for (int t = 0; t < S; ++t) {
      const int pos = w.key_begin + t * kTileKeys + tid;
      key_offset[t][tid] = offset_of(pos, page_of(pos));
    }
  }
  __syncthreads();

  float o[D / 8][4];  // O accumulators: d-tile j holds d = 8 j + 2 tq (+1), rows g (c0 c1) and g + 8 (c2 c3)
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // l: this thread's columns only, summed at the end

  // Tile t goes to stage t % S; tiles 0 .. S - 2 are loaded ahead, one copy group each (empty past the range).
  // Before the wait (early) the new key is left out; it is the last key of the range, so its tile is the last.
  const int new_key = early && w.key_end == w.kv_len ? w.kv_len - 1 - w.key_begin : -1;  // in the range
  const int new_tile = new_key >= 0 ? new_key / kTileKeys : -1;
#pragma unroll
  for (int t = 0; t + 1 < S; ++t) {
    if (t < num_tiles) load_tile(t, key_offset[t], t == new_tile ? new_key % kTileKeys : -1);
    cp_async_commit();
  }
  if (early) wait_then_release();  // Q and the new key's row come from the kernel before
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint32_t* q_row =
        reinterpret_cast<const uint32_t*>(p.q + (row_token(w, row[half], G) * H + row_head(w, row[half], G)) * D);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      qf[kk][half] = row_ok[half] ? q_row[8 * kk + tq] : 0u;          // a0a1 / a2a3: d = 16 kk + 2 tq
      qf[kk][2 + half] = row_ok[half] ? q_row[8 * kk + 4 + tq] : 0u;  // a4a5 / a6a7: d + 8
    }
  }

  if (new_tile >= 0 && new_tile + 1 < S) {
    // The new key's row into its stage, in a group of its own (waited for with every group at the last tile).
    if (tid < Cfg::kChunks) {
      const int key = new_key % kTileKeys;
      const int64_t at = key_offset[new_tile][key] + tid * 8;
      const int dst = new_tile * Cfg::kStageElems + swizzled<D>(key, tid);
      cp_async_16(k_tiles + dst, k_head + at, true);
      cp_async_16(v_tiles + dst, v_head + at, true);
    }
    cp_async_commit();
  }
  for (int it = 0; it < num_tiles; ++it) {
    const int ahead = it + S - 1;  // its stage held tile it - 1, whose math ended with the last __syncthreads
    if (ahead < num_tiles) load_tile(ahead % S, key_offset[ahead % S], -1);
    cp_async_commit();
    const bool fetch = tid < kTileKeys && it + S < num_tiles;
    const int next_pos = w.key_begin + (it + S) * kTileKeys + tid;
    const int next_page = fetch ? page_of(next_pos) : 0;  // used after this tile's math
    // Tile it has landed (the S - 1 later groups may still be in flight; at the last tile, every group).
    if (it + 1 == num_tiles) {
      cp_async_wait<0>();
    } else {
      cp_async_wait<S - 1>();
    }
    __syncthreads();
    const uint16_t* const ks = k_tiles + (it % S) * Cfg::kStageElems;
    const uint16_t* const vs = v_tiles + (it % S) * Cfg::kStageElems;
    const int warp_key0 = warp_n * Cfg::kWarpKeys;            // first key of this warp's slice in the tile
    const int pos0 = w.key_begin + it * kTileKeys + warp_key0;  // its position

    // S = Q K^T over the warp's keys: n-tile j holds keys 8 j + 2 tq (+1).
    float s[Cfg::kWarpKeys / 8][4];
#pragma unroll
    for (int j = 0; j < Cfg::kWarpKeys / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nb = 0; nb < Cfg::kWarpKeys / 16; ++nb) {
        // Matrices: (keys +0..7, d chunk 2kk), (keys +0..7, 2kk+1), (keys +8..15, 2kk), (keys +8..15, 2kk+1).
        const int key = warp_key0 + nb * 16 + (lane / 16) * 8 + lane % 8;
        uint32_t b[4];
        ldmatrix_x4(b, ks + swizzled<D>(key, 2 * kk + (lane / 8) % 2));
        mma_16816(s[2 * nb], qf[kk], b[0], b[1]);
        mma_16816(s[2 * nb + 1], qf[kk], b[2], b[3]);
      }
    }

    // Online softmax: mask (range end, causal), running max over the quad, rescale, P to bf16.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < Cfg::kWarpKeys / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = pos0 + 8 * j + 2 * tq + (e & 1);
        const int half = e / 2;
        const float x = (pos < w.key_end && pos <= last[half]) ? s[j][e] * p.scale_log2 : -INFINITY;
        s[j][e] = x;
        tile_max[half] = fmaxf(tile_max[half], x);
      }
    }
    float base[2];  // the max subtracted in the exponentials (0 while a row has seen no key: avoids inf - inf)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 1));
      tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 2));
      const float m_new = fmaxf(m[half], tile_max[half]);
      base[half] = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = exp2f(m[half] - base[half]);
      m[half] = m_new;
      l[half] *= alpha;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][2 * half] *= alpha;
        o[j][2 * half + 1] *= alpha;
      }
    }
    uint32_t pf[Cfg::kWarpKeys / 8][2];  // P as bf16 pairs: [j][half] = keys 8 j + 2 tq (+1) of row g + 8 half
#pragma unroll
    for (int j = 0; j < Cfg::kWarpKeys / 8; ++j) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t pair = pack_bf16(exp2f(s[j][2 * half] - base[half]), exp2f(s[j][2 * half + 1] - base[half]));
        pf[j][half] = pair;
        l[half] += bf16_lo(pair) + bf16_hi(pair);
      }
    }

    // O += P V: k-step ks covers keys 16 ks .. 16 ks + 15 of the slice (S n-tiles 2 ks and 2 ks + 1).
#pragma unroll
    for (int kstep = 0; kstep < Cfg::kWarpKeys / 16; ++kstep) {
      const uint32_t a[4] = {pf[2 * kstep][0], pf[2 * kstep][1], pf[2 * kstep + 1][0], pf[2 * kstep + 1][1]};
#pragma unroll
      for (int nd = 0; nd < D / 16; ++nd) {
        // Matrices (transposed): (keys +0..7, d chunk 2nd), (keys +8..15, 2nd), (keys +0..7, 2nd+1), (+8..15, 2nd+1).
        const int key = warp_key0 + kstep * 16 + ((lane / 8) % 2) * 8 + lane % 8;
        uint32_t b[4];
        ldmatrix_x4_trans(b, vs + swizzled<D>(key, 2 * nd + lane / 16));
        mma_16816(o[2 * nd], a, b[0], b[1]);
        mma_16816(o[2 * nd + 1], a, b[2], b[3]);
      }
    }
    if (fetch) key_offset[it % S][tid] = offset_of(next_pos, next_page);  // tile it + S's slot: tile it's is spent
    __syncthreads();  // the stage is refilled by the next iteration's load, key_offset read
  }
  cp_async_wait<0>();

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
  }

  if constexpr (!kDecode) {
    // Each warp's rows are complete: write them from the fragments (bf16 pairs, or fp32 pairs of the partial).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (!row_ok[half]) continue;
      const int R = row[half];
      const float inv = l[half] > 0.0f ? 1.0f / l[half] : 0.0f;
      if (w.num_splits == 1) {
        uint16_t* dst = p.out + (row_token(w, R, G) * H + row_head(w, R, G)) * D;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          *reinterpret_cast<uint32_t*>(dst + 8 * j + 2 * tq) = pack_bf16(o[j][2 * half] * inv, o[j][2 * half + 1] * inv);
        }
      } else {
        const int64_t slot = partial_slot(w, R, G, H);
        float* dst = w.part_o + slot * D;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          *reinterpret_cast<float2*>(dst + 8 * j + 2 * tq) = make_float2(o[j][2 * half] * inv, o[j][2 * half + 1] * inv);
        }
        if (tq == 0) w.part_lse[slot] = l[half] > 0.0f ? m[half] + log2f(l[half]) : -INFINITY;
      }
    }
  } else {
    // The 4 warps saw different keys of the same rows: merge (m, l, O) through shared memory, warps in order.
    float* const merge_m = reinterpret_cast<float*>(smem);  // [kWarpsN][16]
    float* const merge_l = merge_m + Cfg::kWarpsN * 16;     // [kWarpsN][16]
    float* const merge_o = merge_l + Cfg::kWarpsN * 16;     // [kWarpsN][16][kOStride]
    float* const cluster_o = merge_m + Cfg::kWarpMergeFloats;  // kCluster: [16][D] this split's rows, then lse [16]
    float* const cluster_lse = cluster_o + 16 * D;
    __syncthreads();  // every warp is done reading the K / V stages this buffer overlays
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = g + 8 * half;
      if (tq == 0) {
        merge_m[warp_n * 16 + r] = m[half];
        merge_l[warp_n * 16 + r] = l[half];
      }
      float* dst = merge_o + (warp_n * 16 + r) * Cfg::kOStride;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        *reinterpret_cast<float2*>(dst + 8 * j + 2 * tq) = make_float2(o[j][2 * half], o[j][2 * half + 1]);
      }
    }
    __syncthreads();
    // 8 threads per row, D / 8 consecutive d each.
    constexpr int kPerThread = D / 8;
    const int r = tid / 8, d0 = (tid % 8) * kPerThread;
    const int R = w.row_begin + r;
    if (R < w.row_end) {
      float m_all = -INFINITY;
#pragma unroll
      for (int wn = 0; wn < Cfg::kWarpsN; ++wn) m_all = fmaxf(m_all, merge_m[wn * 16 + r]);
      const float base = m_all == -INFINITY ? 0.0f : m_all;
      float weight[Cfg::kWarpsN], l_all = 0.0f;
#pragma unroll
      for (int wn = 0; wn < Cfg::kWarpsN; ++wn) {
        weight[wn] = exp2f(merge_m[wn * 16 + r] - base);
        l_all += merge_l[wn * 16 + r] * weight[wn];
      }
      const float inv = l_all > 0.0f ? 1.0f / l_all : 0.0f;
      float val[kPerThread];
#pragma unroll
      for (int dd = 0; dd < kPerThread; ++dd) {
        float acc = 0.0f;
#pragma unroll
        for (int wn = 0; wn < Cfg::kWarpsN; ++wn) acc += merge_o[(wn * 16 + r) * Cfg::kOStride + d0 + dd] * weight[wn];
        val[dd] = acc * inv;
      }
      if (w.num_splits == 1) {
        uint16_t* dst = p.out + (row_token(w, R, G) * H + row_head(w, R, G)) * D + d0;
#pragma unroll
        for (int dd = 0; dd < kPerThread; dd += 8) {
          const uint4 packed = make_uint4(pack_bf16(val[dd], val[dd + 1]), pack_bf16(val[dd + 2], val[dd + 3]),
                                          pack_bf16(val[dd + 4], val[dd + 5]), pack_bf16(val[dd + 6], val[dd + 7]));
          *reinterpret_cast<uint4*>(dst + dd) = packed;
        }
      } else if constexpr (kCluster) {
#pragma unroll
        for (int dd = 0; dd < kPerThread; dd += 4) {
          *reinterpret_cast<float4*>(cluster_o + r * D + d0 + dd) = make_float4(val[dd], val[dd + 1], val[dd + 2], val[dd + 3]);
        }
        if (tid % 8 == 0) cluster_lse[r] = l_all > 0.0f ? m_all + log2f(l_all) : -INFINITY;
      } else {
        const int64_t slot = partial_slot(w, R, G, H);
        float* dst = w.part_o + slot * D + d0;
#pragma unroll
        for (int dd = 0; dd < kPerThread; dd += 4) {
          *reinterpret_cast<float4*>(dst + dd) = make_float4(val[dd], val[dd + 1], val[dd + 2], val[dd + 3]);
        }
        if (tid % 8 == 0) w.part_lse[slot] = l_all > 0.0f ? m_all + log2f(l_all) : -INFINITY;
      }
    }
    if constexpr (kCluster) {
      // Every split's rows are in its CTA's shared memory after the first barrier; split z of the n with keys (its
      // cluster rank) merges rows z, z + n, ... (thread d: dimension d), splits in order with merge_head_splits'
      // weights exp2(lse_z - max), their total summed in split order (merge_head_splits sums it by butterfly: the
      // two merges may differ in the last bf16 bit); the second barrier keeps each CTA's shared memory alive
      // until its peers have read it.
      cg::cluster_group cluster = cg::this_cluster();
      cluster.sync();
      if (w.num_splits > 1 && tid < D) {
        const int d = tid;
        for (int r2 = static_cast<int>(cluster.block_rank()); r2 < w.row_end - w.row_begin; r2 += w.num_splits) {
          float lse[kPagedAttentionMaxCluster];
          float max_lse = -INFINITY;
#pragma unroll
          for (int z = 0; z < kPagedAttentionMaxCluster; ++z) {
            lse[z] = z < w.num_splits ? *cluster.map_shared_rank(cluster_lse + r2, z) : -INFINITY;
            max_lse = fmaxf(max_lse, lse[z]);
          }
          const float base = max_lse == -INFINITY ? 0.0f : max_lse;
          float total = 0.0f, acc = 0.0f;
#pragma unroll
          for (int z = 0; z < kPagedAttentionMaxCluster; ++z) {
            if (z < w.num_splits) {
              const float wz = exp2f(lse[z] - base);
              total += wz;
              acc += wz * *cluster.map_shared_rank(cluster_o + r2 * D + d, z);
            }
          }
          const float inv = total > 0.0f ? 1.0f / total : 0.0f;
          const int R = w.row_begin + r2;
          p.out[(row_token(w, R, G) * H + row_head(w, R, G)) * D + d] = f32_to_bf16(acc * inv);
        }
      }
      cluster.sync();
    } else if (w.num_splits > 1) {
      __shared__ float merge_weights[kThreads / 32][kPagedAttentionMaxSplits];
      finish_decode_splits(p, w, D, merge_weights);
    }
  }
}

template <int D, bool kDecode, int kStages, bool kCluster = false>
cudaError_t launch_mma(const Params& p, dim3 grid, cudaStream_t stream) {
  constexpr size_t kSmem = MmaConfig<D, kDecode, kStages, kCluster>::kSmemBytes;
  const auto kernel = mma_attention_kernel<D, kDecode, kStages, kCluster>;
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem));
  if (status != cudaSuccess) return status;
  if (kCluster && grid.z > 8) {  // above the portable cluster size
    status = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (status != cudaSuccess) return status;
  }
  return launch_dependent_clustered(kernel, grid, dim3(kThreads), kSmem, stream, kCluster ? grid.z : 1u, p);
}

// The decode kernel as planned (PagedAttentionPlan::decode_stages, decode_cluster; launch_paged_attention checked
// that a cluster is the grid's z): with clusters 2, 3 or 4 stages, without them 3 (no split: few CTAs, each walking
// a whole context) or 2. Three stages were measured 3.2% faster at batch 64 context 2048 (one split), within 0.3% at
// batch 16, 0.2-1.1% slower at batch 1 and 4 (bench/results/attention_decode_stages_*).
template <int D>
cudaError_t launch_decode(const Params& p, dim3 grid, cudaStream_t stream) {
  if (p.decode_cluster > 1) {
    switch (p.decode_stages) {
      case 4: return launch_mma<D, true, 4, true>(p, grid, stream);
      case 3: return launch_mma<D, true, 3, true>(p, grid, stream);
      default: return launch_mma<D, true, 2, true>(p, grid, stream);
    }
  }
  return p.decode_stages == 3 ? launch_mma<D, true, 3>(p, grid, stream) : launch_mma<D, true, 2>(p, grid, stream);
}

}  // namespace

cudaError_t launch_mma_attention(const Params& p, int head_dim, bool decode, dim3 grid, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return decode ? launch_decode<64>(p, grid, stream) : launch_mma<64, false, 2>(p, grid, stream);
    case 128: return decode ? launch_decode<128>(p, grid, stream) : launch_mma<128, false, 2>(p, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fulcrum::gpu::attention

namespace fulcrum::gpu {

int paged_attention_max_cluster() {
  using attention::kThreads;
  // The decode kernel with the most shared memory (4 stages at head_dim 128, one CTA per SM).
  const auto kernel = attention::mma_attention_kernel<128, true, 4, true>;
  constexpr size_t kSmem = attention::MmaConfig<128, true, 4, true>::kSmemBytes;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(1, 1, kPagedAttentionMaxCluster);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmem;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = kPagedAttentionMaxCluster;
  config.attrs = &cluster;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess ||
      cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: a query the device refused
    return kPagedAttentionPortableCluster;
  }
  return clusters >= 1 ? kPagedAttentionMaxCluster : kPagedAttentionPortableCluster;
}

}  // namespace fulcrum::gpu
