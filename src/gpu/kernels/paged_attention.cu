// Paged attention: the plan, the workspace layout, the launcher (decode launch, prefill launch, split merge) and
// the merge kernel. The attention kernels are in paged_attention_mma.cu and paged_attention_simt.cu.
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "gpu/kernels/paged_attention.hpp"
#include "gpu/env_switch.hpp"
#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/paged_attention_work.cuh"

namespace fulcrum::gpu {
namespace {

using attention::Params;

constexpr int kMaxPrefillSplits = 16;  // prefill tiles are many; splits only help a few short chunks of a long cache
constexpr int kMergeWarps = attention::kThreads / 32;

bool shape_supported(const PagedAttentionShape& s) {
  if (s.num_seqs < 0 || s.num_tokens < 0 || s.num_heads < 1 || s.num_kv_heads < 1) return false;
  if (!paged_attention_supports_head_dim(s.head_dim) || s.num_heads % s.num_kv_heads != 0) return false;
  const int group = s.num_heads / s.num_kv_heads;
  return group <= kPagedAttentionMaxGroup && kPagedAttentionMaxGroup % group == 0;  // tiles hold whole tokens
}

int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// CTAs per SM the decode KV splits aim for: 1 (one wave; each split then holds several key tiles, and the last
// CTA merges fewer partials). Measured against 0 (no splits), 2, 3 and 4 (the earlier choice) on one H200, decode
// of the 30B-A3B shape at batch 1 / 4 / 16 / 64, context 512 and 2048: best or within 0.5% at six of the eight,
// 5% faster than 4 at batch 4 context 2048, 1.5% slower at batch 64 context 2048
// (bench/results/attention_decode_ctas_sweep_*_h200.json). FULCRUM_ATTENTION_DECODE_CTAS_PER_SM overrides it for
// measurement; read once.
int decode_ctas_per_sm() {
  static const int per_sm = static_cast<int>(std::max(0LL, env_int("FULCRUM_ATTENTION_DECODE_CTAS_PER_SM", 1)));
  return per_sm;
}

// Measurement switches (read once): FULCRUM_ATTENTION_CLUSTER=0 merges every decode split through the workspace
// (and keeps the splits uncut), FULCRUM_ATTENTION_EARLY_KV=0 reads page ids and cached K / V after the wait,
// FULCRUM_ATTENTION_DECODE_STAGES=2, 3 or 4 forces the decode kernel's stages (4 only with clusters).
bool decode_cluster_enabled() {
  static const bool enabled = env_switch_on("FULCRUM_ATTENTION_CLUSTER");
  return enabled;
}
bool early_kv_enabled() {
  static const bool enabled = env_switch_on("FULCRUM_ATTENTION_EARLY_KV");
  return enabled;
}
// Planned kv length up to which decode splits are cut to one cluster: kPagedAttentionClusterMaxKv, or
// FULCRUM_ATTENTION_CLUSTER_MAX_KV for measurement (read once; 0 keeps every split count uncut).
int64_t cluster_max_kv() {
  static const int64_t max_kv = std::max(0LL, env_int("FULCRUM_ATTENTION_CLUSTER_MAX_KV", kPagedAttentionClusterMaxKv));
  return max_kv;
}
// Decode splits the plan cuts a cluster to: the shape's max_cluster, or less by FULCRUM_ATTENTION_CLUSTER_SIZE
// (2..kPagedAttentionMaxCluster) for measurement; read once.
int cluster_size(const PagedAttentionShape& s) {
  static const int size = static_cast<int>(
      std::clamp<long long>(env_int("FULCRUM_ATTENTION_CLUSTER_SIZE", kPagedAttentionMaxCluster), 2, kPagedAttentionMaxCluster));
  return std::clamp(s.max_cluster, 1, size);
}
int forced_decode_stages() {
  static const int forced = [] {
    const long long v = env_int("FULCRUM_ATTENTION_DECODE_STAGES", 0);
    return v >= 2 && v <= 4 ? static_cast<int>(v) : 0;
  }();
  return forced;
}

size_t align_up(size_t bytes) {
  return (bytes + kPagedAttentionWorkspaceAlign - 1) / kPagedAttentionWorkspaceAlign * kPagedAttentionWorkspaceAlign;
}

struct WorkspaceLayout {
  size_t decode_o = 0, decode_lse = 0, prefill_o = 0, prefill_lse = 0, total = 0;  // byte offsets
};

WorkspaceLayout workspace_layout(const PagedAttentionPlan& plan) {
  const PagedAttentionShape& s = plan.shape;
  const size_t per_row = static_cast<size_t>(s.num_heads);  // (row, split) entries have num_heads heads
  const size_t decode_rows =
      plan.decode_splits > 1 && plan.decode_cluster == 1 ? static_cast<size_t>(s.num_seqs) * plan.decode_splits : 0;
  const size_t prefill_rows =
      plan.prefill_tiles > 0 && plan.prefill_splits > 1 ? static_cast<size_t>(s.num_tokens) * plan.prefill_splits : 0;
  WorkspaceLayout w;
  w.decode_o = 0;
  w.decode_lse = align_up(w.decode_o + decode_rows * per_row * s.head_dim * sizeof(float));
  w.prefill_o = align_up(w.decode_lse + decode_rows * per_row * sizeof(float));
  w.prefill_lse = align_up(w.prefill_o + prefill_rows * per_row * s.head_dim * sizeof(float));
  w.total = align_up(w.prefill_lse + prefill_rows * per_row * sizeof(float));
  if (decode_rows == 0 && prefill_rows == 0) w.total = 0;
  return w;
}

// Merges the split partials of the prefill tokens whose tile was split, one block per token, one head per
// warp (blockIdx.y: heads 4y .. 4y + 3). Decode splits are merged inside the decode launch (finish_decode_splits).
__global__ void __launch_bounds__(attention::kThreads) merge_prefill_splits_kernel(const Params p, int head_dim,
                                                                                   int num_tokens) {
  wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  __shared__ float weights[kMergeWarps][kPagedAttentionMaxSplits];
  const int token = static_cast<int>(blockIdx.x);
  if (token >= num_tokens) return;
  int lo = 0, hi = p.num_seqs;  // the last sequence whose first token is <= token
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (p.q_indptr[mid] <= token) lo = mid; else hi = mid;
  }
  const int s = lo, q_begin = p.q_indptr[s], n = p.q_indptr[s + 1] - q_begin;
  if (token < q_begin || token - q_begin >= n || n < 2) return;
  const int tile = (token - q_begin) * p.group / p.prefill_rows;
  const int row_end = min(n * p.group, (tile + 1) * p.prefill_rows);
  const int splits = attention::split_keys(p.kv_len[s] - n + (row_end - 1) / p.group + 1, p.prefill_splits).count;
  if (splits <= 1) return;  // the attention kernel wrote this token's output itself
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int H = p.num_heads, h = static_cast<int>(blockIdx.y) * kMergeWarps + warp;
  if (h >= H) return;
  const int64_t first = static_cast<int64_t>(token) * p.prefill_splits * H + h;  // split z at first + z * H
  attention::merge_head_splits(p.prefill_o, p.prefill_lse, first, H, head_dim, splits, weights[warp],
                               p.out + (static_cast<int64_t>(token) * H + h) * head_dim);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

PagedAttentionPlan plan_paged_attention(const PagedAttentionShape& shape) {
  PagedAttentionPlan plan;
  plan.shape = shape;
  if (plan.shape.max_q_len < 0) plan.shape.max_q_len = shape.num_tokens;
  if (!shape_supported(shape)) return plan;
  const PagedAttentionShape& s = plan.shape;
  const int group = s.num_heads / s.num_kv_heads;
  plan.tensor_cores = !s.force_cuda_cores && (s.head_dim == 64 || s.head_dim == 128);
  plan.prefill_rows = plan.tensor_cores ? 64 : 16;

  // Prefill: about four CTAs per SM over the batch (the tensor-core kernels keep 2-3 resident per SM, so the last
  // wave is mostly full); decode: decode_ctas_per_sm(). A split keeps >= kPagedAttentionSplitAlign positions.
  const int64_t target_ctas = 4 * static_cast<int64_t>(std::max(1, s.num_sms));
  const int64_t splits_by_len = std::max<int64_t>(1, ceil_div64(std::max(1, s.max_kv_len), kPagedAttentionSplitAlign));
  const int64_t decode_ctas = std::max<int64_t>(1, static_cast<int64_t>(s.num_seqs) * s.num_kv_heads);
  const int64_t decode_target = int64_t{decode_ctas_per_sm()} * std::max(1, s.num_sms);
  plan.decode_splits = static_cast<int>(std::clamp<int64_t>(ceil_div64(decode_target, decode_ctas), 1,
                                                            std::min<int64_t>(kPagedAttentionMaxSplits, splits_by_len)));
  // Clusters (tensor cores): up to kPagedAttentionClusterMaxKv planned positions the splits are cut to one cluster
  // of up to max_cluster CTAs (16: each then holds up to four 64-key tiles, all in flight at once when the grid fits
  // one wave), so a small batch merges through DSMEM instead of a fence, an atomic and a read of the workspace from L2.
  const bool clusters = plan.tensor_cores && decode_cluster_enabled();
  const int max_cluster = cluster_size(s);
  if (clusters && max_cluster > 1 && plan.decode_splits > max_cluster && s.max_kv_len <= cluster_max_kv()) {
    plan.decode_splits = max_cluster;
  }
  plan.decode_cluster = clusters && plan.decode_splits > 1 && plan.decode_splits <= max_cluster
                            ? plan.decode_splits
                            : 1;
  // Stages with clusters: 4 (128 KB at head_dim 128, one CTA per SM) while the grid fills at most half the SMs,
  // so every tile of a split of up to 256 keys is in flight; 3 (two CTAs per SM) up to two per SM; else 2.
  const int64_t decode_grid = decode_ctas * plan.decode_splits, sms = std::max(1, s.num_sms);
  plan.decode_stages = plan.decode_splits == 1    ? 3
                       : plan.decode_cluster == 1 ? 2
                       : 2 * decode_grid <= sms   ? 4
                       : decode_grid <= 2 * sms   ? 3
                                                  : 2;
  if (forced_decode_stages() != 0 && (forced_decode_stages() < 4 || plan.decode_cluster > 1)) {
    plan.decode_stages = forced_decode_stages();
  }
  plan.early_kv = plan.tensor_cores && early_kv_enabled();

  if (std::min(s.max_q_len, s.num_tokens) >= 2) {
    // Tiles of sequences with n_s >= 2: sum of ceil(n_s G / rows) <= ceil(T G / rows) + (such sequences).
    const int64_t row_tiles = ceil_div64(static_cast<int64_t>(s.num_tokens) * group, plan.prefill_rows);
    plan.prefill_tiles = static_cast<int>(row_tiles + std::min(s.num_seqs, s.num_tokens / 2));
    const int64_t prefill_ctas = std::max<int64_t>(1, row_tiles) * s.num_kv_heads;
    plan.prefill_splits = static_cast<int>(
        std::clamp<int64_t>(ceil_div64(target_ctas, prefill_ctas), 1, std::min<int64_t>(kMaxPrefillSplits, splits_by_len)));
  }
  return plan;
}

size_t paged_attention_workspace_bytes(const PagedAttentionPlan& plan) { return workspace_layout(plan).total; }

cudaError_t launch_paged_attention(const AttentionBatch& batch, const PagedAttentionPlan& plan, void* workspace,
                                   size_t workspace_bytes, CUstream_st* stream) {
  const PagedAttentionShape& s = plan.shape;
  if (!shape_supported(s) || batch.num_seqs != s.num_seqs || batch.num_tokens != s.num_tokens ||
      batch.num_heads != s.num_heads || batch.num_kv_heads != s.num_kv_heads || batch.head_dim != s.head_dim ||
      batch.page_size < 1) {
    return cudaErrorInvalidValue;
  }
  const WorkspaceLayout layout = workspace_layout(plan);
  if (workspace_bytes < layout.total ||
      (layout.total > 0 && reinterpret_cast<uintptr_t>(workspace) % kPagedAttentionWorkspaceAlign != 0)) {
    return cudaErrorInvalidValue;
  }
  if (s.num_seqs == 0 || s.num_tokens == 0) return cudaSuccess;
  if (!aligned16(batch.q) || !aligned16(batch.out) || !aligned16(batch.k_pool) || !aligned16(batch.v_pool)) {
    return cudaErrorInvalidValue;
  }
  if (plan.decode_splits > 1 && plan.decode_cluster == 1 && batch.split_counters == nullptr) return cudaErrorInvalidValue;
  // Clusters are the tensor-core decode kernel's only, and hold exactly a (sequence, kv head)'s splits.
  if (plan.decode_cluster > 1 && (!plan.tensor_cores || plan.decode_cluster != plan.decode_splits ||
                                  plan.decode_cluster > kPagedAttentionMaxCluster)) {
    return cudaErrorInvalidValue;
  }

  unsigned char* ws = static_cast<unsigned char*>(workspace);
  Params p{};
  p.q = batch.q;
  p.out = batch.out;
  p.k_pool = batch.k_pool;
  p.v_pool = batch.v_pool;
  p.q_indptr = batch.q_indptr;
  p.kv_page_indptr = batch.kv_page_indptr;
  p.page_ids = batch.page_ids;
  p.kv_len = batch.kv_len;
  p.num_seqs = s.num_seqs;
  p.num_heads = s.num_heads;
  p.num_kv_heads = s.num_kv_heads;
  p.group = s.num_heads / s.num_kv_heads;
  p.page_size = batch.page_size;
  p.scale_log2 = batch.sm_scale * 1.4426950408889634f;
  p.decode_splits = plan.decode_splits;
  p.split_counters = batch.split_counters;
  p.decode_cluster = plan.decode_cluster;
  p.decode_stages = plan.decode_stages;
  p.early_kv = plan.early_kv;
  p.prefill_splits = plan.prefill_splits;
  p.prefill_rows = plan.prefill_rows;
  if (layout.total > 0) {
    p.decode_o = reinterpret_cast<float*>(ws + layout.decode_o);
    p.decode_lse = reinterpret_cast<float*>(ws + layout.decode_lse);
    p.prefill_o = reinterpret_cast<float*>(ws + layout.prefill_o);
    p.prefill_lse = reinterpret_cast<float*>(ws + layout.prefill_lse);
  }

  const auto launch = plan.tensor_cores ? attention::launch_mma_attention : attention::launch_simt_attention;
  const auto kv_heads = static_cast<unsigned>(s.num_kv_heads);
  cudaError_t status = launch(p, s.head_dim, /*decode=*/true,
                              dim3(static_cast<unsigned>(s.num_seqs), kv_heads, static_cast<unsigned>(plan.decode_splits)),
                              stream);
  if (status != cudaSuccess) return status;
  if (plan.prefill_tiles > 0) {
    status = launch(p, s.head_dim, /*decode=*/false,
                    dim3(static_cast<unsigned>(plan.prefill_tiles), kv_heads, static_cast<unsigned>(plan.prefill_splits)),
                    stream);
    if (status != cudaSuccess) return status;
  }
  if (plan.prefill_tiles > 0 && plan.prefill_splits > 1) {
    const dim3 grid(static_cast<unsigned>(s.num_tokens), static_cast<unsigned>((s.num_heads + kMergeWarps - 1) / kMergeWarps));
    status = launch_dependent(merge_prefill_splits_kernel, grid, dim3(attention::kThreads), 0, stream, p, s.head_dim,
                              s.num_tokens);
  }
  return status;
}

}  // namespace fulcrum::gpu
