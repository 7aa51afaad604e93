#pragma once
// The routing and permutation plan of a small step in one thread block, shared by the single-block route
// (moe_kernels.cu, launch_small_route_permute) and the router + route cluster kernel (router_route_cluster.cu): one
// token's softmax / top-k / replica lookup by a warp, the recorder's per-block histogram, and the block's
// permutation plan (counts, offsets, each entry's row, each row's token, used slots).
#include <cub/block/block_scan.cuh>

#include "backend/cuda/launch_util.cuh"
#include "gpu/moe/moe_kernels.hpp"

namespace fulcrum::cuda::moe::route_block {

constexpr int kLogitsPerLane = kMaxRouterExperts / 32;

// One token's routing by one warp (lane `lane`): softmax, top-k, weights, static slots or the dynamic draw
// count, and the token's experts counted in s_hist when recording.
__device__ __forceinline__ void route_token(const RouterArgs& a, int64_t t, int lane, unsigned int* s_hist) {
  const bool record = a.histogram != nullptr;
  const int num_experts = a.num_experts, top_k = a.top_k;
  const float* row = a.logits + t * num_experts;  // [E]
  float logit[kLogitsPerLane];
  float max_logit = -INFINITY;
#pragma unroll
  for (int i = 0; i < kLogitsPerLane; ++i) {
    const int e = lane + 32 * i;
    logit[i] = e < num_experts ? row[e] : -INFINITY;
    max_logit = fmaxf(max_logit, logit[i]);
  }
  max_logit = warp_max(max_logit);
  double denom = 0.0, ex[kLogitsPerLane];  // each exponential computed once (double: a long instruction sequence)
#pragma unroll
  for (int i = 0; i < kLogitsPerLane; ++i) {
    ex[i] = lane + 32 * i < num_experts ? exp(static_cast<double>(logit[i]) - max_logit) : 0.0;
    if (lane + 32 * i < num_experts) denom += ex[i];
  }
  denom = warp_sum(denom);
  float prob[kLogitsPerLane];  // -1: not an expert, or already chosen
#pragma unroll
  for (int i = 0; i < kLogitsPerLane; ++i) {
    prob[i] = lane + 32 * i < num_experts ? static_cast<float>(ex[i] / denom) : -1.0f;
  }
  // k rounds of warp-wide argmax; ties go to the lower expert index, as the CPU's sort. A probability (>= 0)
  // orders as its bits, so each round is two warp reductions (redux.sync): the largest key (bits + 1; 0 for a
  // lane without a candidate), then the lowest expert holding it; the same choice as a butterfly of
  // (probability, expert) pairs in two instructions instead of ten shuffles.
  float my_prob = 0.0f, sum = 0.0f;
  int my_expert = -1;
#pragma unroll
  for (int j = 0; j < kMaxTopK; ++j) {
    if (j >= top_k) break;
    float lane_best = -2.0f;
    int lane_e = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kLogitsPerLane; ++i) {
      if (prob[i] > lane_best) {
        lane_best = prob[i];
        lane_e = lane + 32 * i;
      }
    }
    const unsigned key = lane_best >= 0.0f ? __float_as_uint(lane_best) + 1u : 0u;
    const unsigned best_key = __reduce_max_sync(0xffffffffu, key);
    const int best_e = static_cast<int>(
        __reduce_min_sync(0xffffffffu, key == best_key ? static_cast<unsigned>(lane_e) : 0x7fffffffu));
    const float best = __uint_as_float(best_key - 1u);
#pragma unroll
    for (int i = 0; i < kLogitsPerLane; ++i) {
      if (lane + 32 * i == best_e) prob[i] = -1.0f;
    }
    sum += best;  // every lane sums the same values in j order
    if (lane == j) {
      my_prob = best;
      my_expert = best_e;
    }
  }
  int multi = 0;  // dynamic: entries whose expert has several replicas
  if (lane < top_k) {
    const int64_t entry = t * top_k + lane;
    a.expert_ids[entry] = my_expert;
    a.weights[entry] = a.norm_topk_prob ? my_prob / sum : my_prob;
    if (a.static_slot_of != nullptr) {
      const int64_t source = t / a.tokens_per_source;
      a.slots[entry] = a.static_slot_of[source * num_experts + my_expert];
    } else {
      multi = a.replica_offsets[my_expert + 1] - a.replica_offsets[my_expert] > 1 ? 1 : 0;
    }
    if (record) atomicAdd(&s_hist[my_expert], 1u);
  }
  if (a.static_slot_of == nullptr) {
    multi = warp_sum(multi);
    if (lane == 0) a.multi_draws[t] = multi;
  }
}

// The block's shared histogram [E] zeroed (record only); every thread calls it.
__device__ __forceinline__ void clear_histogram(const RouterArgs& a, unsigned int* s_hist) {
  if (a.histogram == nullptr) return;
  for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) s_hist[e] = 0;
  __syncthreads();
}
// The block's counts added to the recorder row, one atomicAdd per expert with tokens; every thread calls it.
__device__ __forceinline__ void flush_histogram(const RouterArgs& a, const unsigned int* s_hist) {
  if (a.histogram == nullptr) return;
  __syncthreads();
  for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) {
    if (s_hist[e] != 0) atomicAdd(&a.histogram[e], static_cast<unsigned long long>(s_hist[e]));
  }
}

// One block of kThreads (kSmallPlanThreads, or kTinyPlanThreads for a step of at most 32 entries): counts in
// shared memory, block scans over the slots in chunks of the block (offsets, and which slots have rows), then each
// entry's rank among the earlier entries of its slot. The outputs do not depend on the block size.
constexpr int kSmallPlanThreads = 1024;
// Decode steps of up to 4 tokens at top-8 (the skinny path's): a block of 4 warps, whose barriers and scans cost a
// fraction of the 1024-thread block's on a step that has 8..32 entries.
constexpr int kTinyPlanThreads = 128;
// Static dispatch entries (sources x experts) the small route copies to shared memory before its wait.
constexpr int kSmallRouteSlotEntries = 1024;
// Where the entries' slots start in plan_smem: after counts [P] and first rows [P], rounded up to 4 int32 so that the
// rank loop reads them 16 bytes at a time.
__host__ __device__ constexpr int plan_entry_slot_offset(int num_slots) { return (2 * num_slots + 3) & ~3; }
// plan_smem: [plan_entry_slot_offset(P) + N] int32. Every thread of the block calls it; slots may have been written
// by this block (the caller synchronized after).
template <int kThreads>
__device__ __forceinline__ void small_permutation_block(const int32_t* slots, int num_entries, int top_k,
                                                        int num_slots, int32_t* slot_counts, int32_t* offsets,
                                                        int32_t* entry_row, int32_t* row_token, int32_t* active,
                                                        int32_t* plan_smem) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  int32_t* counts = plan_smem;                 // [P]
  int32_t* first_row = counts + num_slots;     // [P]
  int32_t* entry_slot = plan_smem + plan_entry_slot_offset(num_slots);  // [N], 16-byte aligned
  const int tid = static_cast<int>(threadIdx.x);
  for (int q = tid; q < num_slots; q += kThreads) counts[q] = 0;
  for (int e = tid; e < num_entries; e += kThreads) entry_slot[e] = slots[e];
  __syncthreads();
  for (int e = tid; e < num_entries; e += kThreads) atomicAdd(&counts[entry_slot[e]], 1);
  __syncthreads();
  int rows_before = 0, active_before = 0;
  for (int base = 0; base < num_slots; base += kThreads) {
    const int q = base + tid;
    const int count = q < num_slots ? counts[q] : 0;
    int row = 0, rows_total = 0, rank = 0, active_total = 0;
    Scan(scan_storage).ExclusiveSum(count, row, rows_total);
    __syncthreads();
    Scan(scan_storage).ExclusiveSum(count > 0 ? 1 : 0, rank, active_total);
    __syncthreads();
    if (q < num_slots) {
      slot_counts[q] = count;
      offsets[q] = rows_before + row;
      first_row[q] = rows_before + row;
      if (count > 0) active[1 + active_before + rank] = q;
    }
    rows_before += rows_total;
    active_before += active_total;
  }
  if (tid == 0) {
    offsets[num_slots] = rows_before;
    active[0] = active_before;
  }
  __syncthreads();
  // An entry's rank: the earlier entries of its slot. Four slots per shared-memory read (the warp's lanes read the
  // same words: broadcasts), unrolled so that several reads are in flight, where one slot a read made a
  // shared-memory round trip per earlier entry (up to 1023). Its own effect was not measured apart.
  const int4* slots4 = reinterpret_cast<const int4*>(entry_slot);
  for (int e = tid; e < num_entries; e += kThreads) {
    const int slot = entry_slot[e];
    int rank = 0;
    const int quads = e / 4;
#pragma unroll 4
    for (int f = 0; f < quads; ++f) {
      const int4 v = slots4[f];
      rank += (v.x == slot) + (v.y == slot) + (v.z == slot) + (v.w == slot);
    }
    for (int f = 4 * quads; f < e; ++f) rank += entry_slot[f] == slot;
    const int row = first_row[slot] + rank;
    entry_row[e] = row;
    row_token[row] = e / top_k;
  }
}

// Where the [E] histogram counts start in the small route's dynamic shared memory (after the plan's int32s), and
// that memory's size in bytes.
__host__ __device__ constexpr int small_route_hist_offset(int num_slots, int num_entries) {
  return plan_entry_slot_offset(num_slots) + num_entries;
}
__host__ __device__ constexpr size_t small_route_smem_bytes(int num_slots, int num_entries, int num_experts, bool record) {
  return 4 * static_cast<size_t>(small_route_hist_offset(num_slots, num_entries)) +
         (record ? 4 * static_cast<size_t>(num_experts) : 0);
}

// Before the PDL wait, what no kernel of the step writes: the histogram cleared and, for a step of few sources, the
// static dispatch rows of its sources copied to s_slot_of [kSmallRouteSlotEntries] (they change only between
// steps), so the lookup after the routing is not a global round trip. Every thread calls it.
template <int kThreads>
__device__ __forceinline__ void stage_before_wait(RouterArgs& a, unsigned int* s_hist, int32_t* s_slot_of) {
  clear_histogram(a, s_hist);
  const int64_t sources = (a.num_tokens + a.tokens_per_source - 1) / a.tokens_per_source;
  if (sources * a.num_experts <= kSmallRouteSlotEntries) {
    for (int i = threadIdx.x; i < sources * a.num_experts; i += kThreads) s_slot_of[i] = __ldg(a.static_slot_of + i);
    __syncthreads();
    a.static_slot_of = s_slot_of;
  }
}

// After the wait: warp w routes tokens w, w + kThreads / 32, ..., then the block permutes the slots it wrote.
// plan_smem: small_route_smem_bytes of dynamic shared memory (s_hist inside it). Every thread calls it.
template <int kThreads>
__device__ __forceinline__ void route_and_plan(const RouterArgs& a, int num_slots, int32_t* slot_counts,
                                               int32_t* offsets, int32_t* entry_row, int32_t* row_token,
                                               int32_t* active, int32_t* plan_smem, unsigned int* s_hist) {
  const int num_entries = static_cast<int>(a.num_tokens) * a.top_k;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t t = warp; t < a.num_tokens; t += kThreads / 32) route_token(a, t, lane, s_hist);
  flush_histogram(a, s_hist);
  __syncthreads();  // the slots written above, for the whole block
  small_permutation_block<kThreads>(a.slots, num_entries, a.top_k, num_slots, slot_counts, offsets, entry_row,
                                    row_token, active, plan_smem);
}

}  // namespace fulcrum::cuda::moe::route_block
