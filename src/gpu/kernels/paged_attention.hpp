#pragma once
// The engine's own paged attention over a ragged batch (gpu::AttentionBatch, attention_batch.hpp; CPU reference
// gpu::reference::paged_attention), in the style of src/gpu/moe/moe_kernels.hpp: a host plan, then a
// launcher that enqueues on `stream` and returns the launch status. Kernels: paged_attention.cu (launcher, split
// merge), paged_attention_mma.cu (tensor cores, head_dim 64 / 128), paged_attention_simt.cu (CUDA cores, every
// head_dim; the fallback).
//
// Work is cut in two launches by each sequence's query count n_s, read on the device:
//   decode  (n_s == 1): one CTA per (sequence, kv head, KV split) holds the group's q heads as the rows of one
//           16-row tile, so every K/V row is read once for all of them;
//   prefill (n_s >= 2): CTAs over tiles of query rows (row = token x group head; rows of one kv head), causal.
// When a row's keys are cut into splits, each split makes (normalized partial output, log2-sum-exp) and they are
// merged in split order: for decode rows inside the decode launch, either within a thread block cluster holding the
// (sequence, kv head)'s splits (PagedAttentionPlan::decode_cluster: through distributed shared memory) or from the
// workspace by the last CTA to finish (counted in AttentionBatch::split_counters; no third launch, which cost more
// than the attention itself at batch 1); for prefill rows from the workspace by a third launch. Splits cut positions at multiples of 64 chosen from
// kv_len and the plan alone, every sum runs in position order: the output does not depend on the page layout
// (page ids, page size), bit for bit.
//
// CUDA-graph capture: grids depend only on the plan; lengths, indptrs and page ids are read from device memory;
// a sequence with 0 new tokens and a CTA without work exit at once. Nothing is allocated or synchronized.
// Tokens outside every sequence's [q_indptr[s], q_indptr[s + 1]) (a padded bucket) are not written.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "gpu/kernels/attention_batch.hpp"

namespace fulcrum::gpu {

constexpr int kPagedAttentionMaxGroup = 16;  // num_heads / num_kv_heads: the decode rows of one 16-row tile
constexpr int kPagedAttentionMaxSplits = 64;
constexpr int kPagedAttentionSplitAlign = 64;          // keys of a split: a multiple of this (except the last)
constexpr int kPagedAttentionMaxCluster = 16;          // decode splits one cluster may hold (sm_90's non-portable size)
constexpr int kPagedAttentionPortableCluster = 8;      // the largest cluster every device schedules
constexpr int kPagedAttentionClusterMaxKv = 4096;      // planned kv length up to which decode splits are cut to fit one
constexpr size_t kPagedAttentionWorkspaceAlign = 256;  // the workspace pointer's alignment

constexpr bool paged_attention_supports_head_dim(int head_dim) {
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// Host values the plan may depend on; for a CUDA graph bucket they are the bucket's, fixed across replays.
struct PagedAttentionShape {
  int num_seqs = 0;
  int num_tokens = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int max_kv_len = 0;   // upper bound on every kv_len[s] (splits are planned for it)
  int max_q_len = -1;   // upper bound on every n_s; -1: num_tokens. 1 (a decode bucket) drops the prefill launch
  int num_sms = 132;    // streaming multiprocessors of the device (H200: 132)
  int max_cluster = kPagedAttentionMaxCluster;  // the largest decode cluster the device schedules (paged_attention_max_cluster)
  bool force_cuda_cores = false;  // the CUDA-core kernels even where tensor-core ones exist (tests, fallback)
};

struct PagedAttentionPlan {
  PagedAttentionShape shape;  // what was planned for; the launcher checks the batch against it
  bool tensor_cores = false;  // mma.sync kernels (head_dim 64 / 128) or the CUDA-core ones
  int decode_splits = 1;      // grid z of the decode launch: at most this many KV splits per 1-token sequence
  // > 1 (= decode_splits): the splits of a (sequence, kv head) run as one thread block cluster and merge their
  // partials through distributed shared memory (no workspace, no counters); 1: the last split to finish merges
  // them from the workspace (AttentionBatch::split_counters).
  int decode_cluster = 1;
  int decode_stages = 2;      // K / V tiles of 64 keys in flight per decode CTA (tensor cores: 2, 3 or 4)
  bool early_kv = true;       // decode CTAs load page ids and cached K / V before waiting for the kernel before
  int prefill_rows = 0;       // query rows (token x group head) per prefill CTA: 64 tensor cores, 16 CUDA cores
  int prefill_tiles = 0;      // grid x of the prefill launch (a bound on the batch's tiles); 0: no prefill launch
  int prefill_splits = 1;     // grid z of the prefill launch: at most this many KV splits per tile
};

// The plan from host values only. Decode splits aim at one CTA per SM, prefill splits at about four; each split
// holds >= 64 positions; up to kPagedAttentionClusterMaxKv planned positions (tensor cores) decode splits are cut to
// max_cluster (16 on an H100 / H200) and merged in a cluster (a lone decode sequence with 4096 planned positions and
// 4 kv heads: 16 splits of up to 256 keys, 64 CTAs; with 8192: 33 splits of 256, merged through the workspace; 4
// sequences: 9 splits in clusters of 9; 16 sequences: 3 splits in clusters of 3, 192 CTAs; 64 sequences: no split). 4096, not 2048: the engine's decode
// graphs plan for the power of two above the longest sequence, so a 2048-token context ran on the workspace path
// (11.45 against 6.82 us a launch at batch 1 on an H100; at 4096 real positions 13.1 against 12.7, at 8192 25.2
// against 17.7: bench/results/attention_cluster_max_kv_c2b7225_h100.txt).
// An unsupported shape (head_dim, group above kPagedAttentionMaxGroup, num_heads % num_kv_heads) gives a plan
// that the launcher refuses.
PagedAttentionPlan plan_paged_attention(const PagedAttentionShape& shape);

// The largest decode cluster the current device can schedule: kPagedAttentionMaxCluster where the decode kernel
// (4 stages, the most shared memory) fits a non-portable cluster of that size (H100, H200), else
// kPagedAttentionPortableCluster. Clusters of 16 against 8: decode steps at context 2048 2.5-3.5% faster at batch 1
// and 4, at 512 1.2% at batch 4, equal at batch 1 (one H200, bench/results/cluster_size_sweep_bedbd98_h200.json).
int paged_attention_max_cluster();

// Bytes of the workspace launch_paged_attention needs (0 when no row is split): decode partials
// [num_seqs][decode_splits][num_heads] x (head_dim + 1) fp32 and prefill partials
// [num_tokens][prefill_splits][num_heads] x (head_dim + 1) fp32, each region 256-byte aligned.
size_t paged_attention_workspace_bytes(const PagedAttentionPlan& plan);

// Runs attention over `batch` as planned. The batch's num_seqs, num_tokens, heads and head_dim must equal the
// plan's. A kv_len above max_kv_len is still right (its splits get longer); with max_q_len 1 a sequence of more
// tokens is not computed. The workspace (device, 256-byte aligned, at least paged_attention_workspace_bytes) is
// scratch, overwritten; q, out, k_pool and v_pool must be 16-byte aligned.
// cudaErrorInvalidValue for a batch that does not match the plan, an unsupported shape, page_size < 1, a
// small / misaligned workspace, decode splits merged through the workspace without split_counters, or a cluster
// size other than the decode splits; otherwise the launch status.
cudaError_t launch_paged_attention(const AttentionBatch& batch, const PagedAttentionPlan& plan, void* workspace,
                                   size_t workspace_bytes, CUstream_st* stream);

}  // namespace fulcrum::gpu
