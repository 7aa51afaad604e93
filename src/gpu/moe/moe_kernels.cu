// Kernels of the GPU MoE layer: router (softmax, top-k, renormalization, replica choice, recorder
// histogram), permutation by physical slot, SwiGLU activation, combine. See moe_kernels.hpp.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "backend/cuda/launch_util.cuh"
#include "gpu/moe/moe_kernels.hpp"
#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/fp8_block_quant.cuh"  // unpack8: 8 bf16 of one 16-byte load

namespace fulcrum::cuda::moe {
namespace {

constexpr int kRouterWarps = 8;
constexpr int kTokensPerRouterBlock = 64;  // shared histogram flushed once per 64 tokens
// Below this many tokens a block takes one token per warp: decode batches spread over more SMs (a block of
// 64 tokens made one SM route a whole batch of 64 one token per warp after another: 34 us on an H200).
constexpr int64_t kRouterSpreadBelowTokens = 4096;
constexpr int kLogitsPerLane = kMaxRouterExperts / 32;
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;  // SplitMix64 increment (eplb::SplitMix64)

__device__ __forceinline__ uint64_t splitmix_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

__device__ __forceinline__ float bf16_to_f32(uint16_t bits) { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }
__device__ __forceinline__ uint16_t f32_to_bf16(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

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

__global__ void moe_router_kernel(RouterArgs a, int tokens_per_block) {
  gpu::wait_then_release();  // gpu/kernels/dependent_launch.cuh: before any read of an earlier kernel's output
  extern __shared__ unsigned int s_hist[];  // [E] when recording
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  clear_histogram(a, s_hist);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * tokens_per_block;
  const int64_t last = min(first + tokens_per_block, a.num_tokens);
  for (int64_t t = first + warp; t < last; t += kRouterWarps) route_token(a, t, lane, s_hist);
  flush_histogram(a, s_hist);
}

__global__ void dynamic_pick_kernel(const int32_t* expert_ids, const int32_t* draw_base, int64_t num_tokens, int top_k,
                                    int64_t tokens_per_source, const uint64_t* source_streams,
                                    const int32_t* replica_offsets, const int32_t* replica_slots, int32_t* slots) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < num_tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t source = t / tokens_per_source;
    const int64_t base = draw_base[t] - draw_base[source * tokens_per_source];
    const uint64_t stream = source_streams[source];
    const int32_t* ids = expert_ids + t * top_k;
    for (int j = 0; j < top_k; ++j) {
      const int e = ids[j];
      const int first = replica_offsets[e], num_replicas = replica_offsets[e + 1] - first;
      if (num_replicas == 1) {
        slots[t * top_k + j] = replica_slots[first];
        continue;
      }
      // Draws are taken in ascending expert order: count the token's lower experts that drew before.
      int64_t draw = base;
      for (int i = 0; i < top_k; ++i) {
        const int other = ids[i];
        if (other < e && replica_offsets[other + 1] - replica_offsets[other] > 1) ++draw;
      }
      const uint64_t z = splitmix_mix(stream + static_cast<uint64_t>(draw + 1) * kGolden);
      const auto pick = static_cast<int>(((z >> 32) * static_cast<uint64_t>(num_replicas)) >> 32);
      slots[t * top_k + j] = replica_slots[first + pick];
    }
  }
}

// One block of 1024 threads walks the array in chunks, carrying the running total.
__global__ void exclusive_scan_kernel(const int32_t* values, int64_t n, int32_t* out, int32_t* total) {
  __shared__ int32_t warp_totals[32];
  __shared__ int32_t carry;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t begin = 0; begin < n; begin += blockDim.x) {
    const int64_t i = begin + threadIdx.x;
    const int32_t v = i < n ? values[i] : 0;
    int32_t inclusive = v;
    for (int offset = 1; offset < 32; offset *= 2) {
      const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += up;
    }
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
      int32_t w = warp_totals[lane];
      for (int offset = 1; offset < 32; offset *= 2) {
        const int32_t up = __shfl_up_sync(0xffffffffu, w, offset);
        if (lane >= offset) w += up;
      }
      warp_totals[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int32_t before = carry + (warp > 0 ? warp_totals[warp - 1] : 0);
    if (i < n) out[i] = before + inclusive - v;
    __syncthreads();
    if (threadIdx.x == 0) carry += warp_totals[31];
    __syncthreads();
  }
  if (threadIdx.x == 0 && total != nullptr) *total = carry;
}

__global__ void slot_counts_kernel(const int32_t* slots, int64_t num_entries, int32_t* slot_counts) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_entries;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    atomicAdd(&slot_counts[slots[i]], 1);
  }
}

// A warp copies one row of n 16-byte words, kCopyAhead words a lane loaded before any is stored: one load and
// store at a time left a warp one HBM round trip per 512 bytes (the compiler may not move a load above a store
// that could alias it), and the 16384-token permutation at 3.1 TB/s.
constexpr int kCopyAhead = 8;
__device__ __forceinline__ void copy_row16(const uint4* src, uint4* dst, int n, int lane) {
  for (int c0 = lane; c0 < n; c0 += 32 * kCopyAhead) {
    uint4 raw[kCopyAhead];
#pragma unroll
    for (int u = 0; u < kCopyAhead; ++u) {
      if (c0 + 32 * u < n) raw[u] = src[c0 + 32 * u];
    }
#pragma unroll
    for (int u = 0; u < kCopyAhead; ++u) {
      if (c0 + 32 * u < n) dst[c0 + 32 * u] = raw[u];
    }
  }
}

// One warp per entry: claim a row of the entry's slot, then copy the token's row into it.
__global__ void permute_rows_kernel(const uint16_t* x, int64_t num_entries, int top_k, int hidden_size,
                                    const int32_t* slots, int32_t* cursor, int32_t* entry_row, uint16_t* permuted) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t entry = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; entry < num_entries;
       entry += warps) {
    int32_t row = 0;
    if (lane == 0) row = atomicAdd(&cursor[slots[entry]], 1);
    row = __shfl_sync(0xffffffffu, row, 0);
    if (lane == 0) entry_row[entry] = row;
    const uint16_t* src = x + (entry / top_k) * hidden_size;
    uint16_t* dst = permuted + static_cast<int64_t>(row) * hidden_size;
    if (hidden_size % 8 == 0) {  // 16-byte rows of 8 bf16
      copy_row16(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), hidden_size / 8, lane);
    } else {
      for (int c = lane; c < hidden_size; c += 32) dst[c] = src[c];
    }
  }
}

template <bool kVector>
__global__ void gather_rows_kernel(const uint16_t* x, const int32_t* row_token, int64_t num_rows, int hidden_size,
                                   uint16_t* permuted) {
  gpu::wait_then_release();  // gpu/kernels/dependent_launch.cuh: row_token comes from the previous kernel
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; row < num_rows;
       row += warps) {
    const uint16_t* src = x + static_cast<int64_t>(row_token[row]) * hidden_size;
    uint16_t* dst = permuted + row * hidden_size;
    if constexpr (kVector) {
      copy_row16(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), hidden_size / 8, lane);
    } else {
      for (int c = lane; c < hidden_size; c += 32) dst[c] = src[c];
    }
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

__global__ void __launch_bounds__(kSmallPlanThreads) small_permutation_kernel(
    const int32_t* slots, int num_entries, int top_k, int num_slots, int32_t* slot_counts, int32_t* offsets,
    int32_t* entry_row, int32_t* row_token, int32_t* active) {
  gpu::wait_then_release();  // gpu/kernels/dependent_launch.cuh: before any read of an earlier kernel's output
  extern __shared__ __align__(16) int32_t plan_smem[];
  small_permutation_block<kSmallPlanThreads>(slots, num_entries, top_k, num_slots, slot_counts, offsets, entry_row,
                                             row_token, active, plan_smem);
}

// The permutation of at most 32 entries by one warp (lane e holds entry e), the same outputs as
// small_permutation_block: an entry's rank among the earlier entries of its slot from __match_any_sync, the
// offsets and active slots from warp scans over the slots in chunks of 32. No block barrier and no global round
// trip for the slots: the block variant's two block scans and five barriers were most of a one-token step's
// route kernel (ncu at acee781: 6.6 us, 54% of its stalls at barriers). plan_smem as the block variant's: counts
// [P] zeroed by this warp before the kernel's dependent-launch wait (they become first rows in place), the
// entries' slots at plan_entry_slot_offset(P), written by the routing warps (the caller synchronized after).
__device__ __forceinline__ void tiny_permutation_warp(int num_entries, int top_k, int num_slots, int32_t* slots,
                                                      int32_t* slot_counts, int32_t* offsets, int32_t* entry_row,
                                                      int32_t* row_token, int32_t* active, int32_t* plan_smem) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x % 32);
  int32_t* first_row = plan_smem;  // [P]: counts, then (in place) the first row of each slot
  const bool has_entry = lane < num_entries;
  const int slot = has_entry ? plan_smem[plan_entry_slot_offset(num_slots) + lane] : -1;
  if (has_entry) slots[lane] = slot;  // the routing's output, as the block variant leaves it
  const unsigned peers = __match_any_sync(kAll, slot) & __ballot_sync(kAll, has_entry);
  const int rank = __popc(peers & ((1u << lane) - 1u));
  if (has_entry && rank == 0) first_row[slot] = __popc(peers);
  __syncwarp();
  int rows_before = 0, active_before = 0;
  for (int base = 0; base < num_slots; base += 32) {
    const int q = base + lane;
    const int count = q < num_slots ? first_row[q] : 0;
    int inclusive = count;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int up = __shfl_up_sync(kAll, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    const unsigned with_rows = __ballot_sync(kAll, count > 0);
    if (q < num_slots) {
      const int row = rows_before + inclusive - count;
      slot_counts[q] = count;
      offsets[q] = row;
      first_row[q] = row;
      if (count > 0) active[1 + active_before + __popc(with_rows & ((1u << lane) - 1u))] = q;
    }
    rows_before += __shfl_sync(kAll, inclusive, 31);
    active_before += __popc(with_rows);
  }
  if (lane == 0) {
    offsets[num_slots] = rows_before;
    active[0] = active_before;
  }
  __syncwarp();
  if (has_entry) {
    const int row = first_row[slot] + rank;
    entry_row[lane] = row;
    row_token[row] = lane / top_k;
  }
}

// Routing (static replicas) and the permutation of a small step in one block: warp w routes tokens w, w + 32, ...,
// then the block permutes the slots it wrote (kWarpPlan, at most 32 entries: warp 0 alone, tiny_permutation_warp).
// Dynamic shared memory: [plan_entry_slot_offset(P) + N] int32, then [E] histogram counts.
template <int kThreads, bool kWarpPlan>
__global__ void __launch_bounds__(kThreads) small_route_permute_kernel(
    RouterArgs a, int num_slots, int32_t* slot_counts, int32_t* offsets, int32_t* entry_row,
    int32_t* row_token, int32_t* active) {
  extern __shared__ __align__(16) int32_t plan_smem[];
  const int num_entries = static_cast<int>(a.num_tokens) * a.top_k;
  unsigned int* s_hist = reinterpret_cast<unsigned int*>(plan_smem + plan_entry_slot_offset(num_slots) + num_entries);
  int32_t* const slots_out = a.slots;
  if constexpr (kWarpPlan) {
    if (threadIdx.x < 32) {
      for (int q = static_cast<int>(threadIdx.x); q < num_slots; q += 32) plan_smem[q] = 0;
    }
    a.slots = plan_smem + plan_entry_slot_offset(num_slots);  // route_token writes the slots here
  }
  // Before the wait, what no kernel of the step writes: the histogram cleared and, for a step of few sources, the
  // static dispatch rows of its sources copied to shared memory (they change only between steps), so the lookup
  // after the routing is not a global round trip.
  clear_histogram(a, s_hist);
  const int64_t sources = (a.num_tokens + a.tokens_per_source - 1) / a.tokens_per_source;
  if (sources * a.num_experts <= kSmallRouteSlotEntries) {
    __shared__ int32_t s_slot_of[kSmallRouteSlotEntries];
    for (int i = threadIdx.x; i < sources * a.num_experts; i += kThreads) s_slot_of[i] = __ldg(a.static_slot_of + i);
    __syncthreads();
    a.static_slot_of = s_slot_of;
  }
  gpu::wait_then_release();  // gpu/kernels/dependent_launch.cuh: before any read of an earlier kernel's output
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t t = warp; t < a.num_tokens; t += kThreads / 32) route_token(a, t, lane, s_hist);
  flush_histogram(a, s_hist);
  __syncthreads();  // the slots written above, for the whole block
  if constexpr (kWarpPlan) {
    if (threadIdx.x < 32) {
      tiny_permutation_warp(num_entries, a.top_k, num_slots, slots_out, slot_counts, offsets, entry_row, row_token,
                            active, plan_smem);
    }
  } else {
    small_permutation_block<kThreads>(slots_out, num_entries, a.top_k, num_slots, slot_counts, offsets, entry_row,
                                      row_token, active, plan_smem);
  }
}

// bf16(silu(gate) * up) in fp32, the one expression every SwiGLU kernel here evaluates (so their bits agree).
__device__ __forceinline__ uint16_t silu_times_bf16(float gate, float up) {
  return f32_to_bf16(gate / (1.0f + expf(-gate)) * up);
}

__global__ void silu_mul_bf16_kernel(const uint16_t* h, int64_t num_rows, int intermediate_size, uint16_t* act) {
  const int64_t n = num_rows * intermediate_size;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / intermediate_size, i = idx % intermediate_size;
    const float gate = bf16_to_f32(h[r * 2 * intermediate_size + i]);
    const float up = bf16_to_f32(h[r * 2 * intermediate_size + intermediate_size + i]);
    act[idx] = silu_times_bf16(gate, up);
  }
}

__global__ void silu_mul_bf16_rows_kernel(const uint16_t* h, const int32_t* row_begin, const int32_t* row_end,
                                          int64_t max_rows, int intermediate_size, uint16_t* act) {
  gpu::wait_then_release();  // gpu/kernels/dependent_launch.cuh: h comes from the previous kernel
  const int64_t first = *row_begin;
  const int64_t rows = min(static_cast<int64_t>(*row_end) - first, max_rows);
  const int64_t n = rows * intermediate_size;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = first + idx / intermediate_size, i = idx % intermediate_size;
    const float gate = bf16_to_f32(h[r * 2 * intermediate_size + i]);
    const float up = bf16_to_f32(h[r * 2 * intermediate_size + intermediate_size + i]);
    act[r * intermediate_size + i] = silu_times_bf16(gate, up);
  }
}

// The same, 8 columns a thread through 16-byte loads and stores (intermediate_size % 8 == 0, h and act 16-byte
// aligned): the scalar kernel's 2-byte accesses and per-element 64-bit divide held the expert stage back between
// its two GEMMs. Each element is silu_times_bf16, so the results are equal bit for bit.
__global__ void silu_mul_bf16_rows_vec8_kernel(const uint16_t* h, const int32_t* row_begin, const int32_t* row_end,
                                               int64_t max_rows, int intermediate_size, uint16_t* act) {
  gpu::wait_then_release();  // gpu/kernels/dependent_launch.cuh: h comes from the previous kernel
  const int64_t first = *row_begin;
  const int64_t rows = min(static_cast<int64_t>(*row_end) - first, max_rows);
  const int per_row = intermediate_size / 8;
  const int64_t n = rows * per_row;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = first + idx / per_row;
    const int c8 = static_cast<int>(idx - (r - first) * per_row);
    const uint4* in_row = reinterpret_cast<const uint4*>(h + r * 2 * intermediate_size);
    float gate[8], up[8];
    gpu::fp8_block::unpack8(in_row[c8], gate);
    gpu::fp8_block::unpack8(in_row[per_row + c8], up);
    uint32_t ow[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      ow[q] = static_cast<uint32_t>(silu_times_bf16(gate[2 * q], up[2 * q])) |
              (static_cast<uint32_t>(silu_times_bf16(gate[2 * q + 1], up[2 * q + 1])) << 16);
    }
    reinterpret_cast<uint4*>(act + r * intermediate_size)[c8] = make_uint4(ow[0], ow[1], ow[2], ow[3]);
  }
}

// One block per token: its k rows and weights in shared memory, columns spread over the threads.
__global__ void combine_kernel(const uint16_t* rows, const int32_t* entry_row, const float* weights, int64_t num_tokens,
                               int top_k, int hidden_size, float* out) {
  gpu::wait_then_release();  // gpu/kernels/dependent_launch.cuh: before any read of an earlier kernel's output
  __shared__ int32_t s_row[kMaxTopK];
  __shared__ float s_weight[kMaxTopK];
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    __syncthreads();
    if (threadIdx.x < top_k) {
      s_row[threadIdx.x] = entry_row[t * top_k + threadIdx.x];
      s_weight[threadIdx.x] = weights[t * top_k + threadIdx.x];
    }
    __syncthreads();
    if (hidden_size % 8 == 0) {
      for (int c8 = threadIdx.x; c8 < hidden_size / 8; c8 += blockDim.x) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int j = 0; j < top_k; ++j) {
          const uint4 v = reinterpret_cast<const uint4*>(rows + static_cast<int64_t>(s_row[j]) * hidden_size)[c8];
          const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            acc[2 * q] += s_weight[j] * bf16_to_f32(static_cast<uint16_t>(words[q] & 0xffffu));
            acc[2 * q + 1] += s_weight[j] * bf16_to_f32(static_cast<uint16_t>(words[q] >> 16));
          }
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) out[t * hidden_size + c8 * 8 + q] = acc[q];
      }
    } else {
      for (int c = threadIdx.x; c < hidden_size; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j) acc += s_weight[j] * bf16_to_f32(rows[static_cast<int64_t>(s_row[j]) * hidden_size + c]);
        out[t * hidden_size + c] = acc;
      }
    }
  }
}

__global__ void fill_random_bf16_kernel(uint16_t* out, int64_t n, uint64_t seed, float scale, int64_t first_index) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t z = splitmix_mix(seed + static_cast<uint64_t>(first_index + i + 1) * kGolden);
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    out[i] = f32_to_bf16((2.0f * u - 1.0f) * scale);
  }
}

__global__ void fill_random_e4m3_kernel(uint8_t* out, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t z = splitmix_mix(seed + static_cast<uint64_t>(i + 1) * kGolden);
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    out[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8((2.0f * u - 1.0f) * 448.0f, __NV_SATFINITE, __NV_E4M3));
  }
}

__global__ void fill_f32_kernel(float* out, int64_t n, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = value;
  }
}

// One block per (source, chunk), one thread per token: bit i of mask[e] marks the chunk's i-th token as
// routed to e (a token's experts are distinct), so an entry's rank among the chunk's entries of e is the
// popcount of the bits below its token; the chunk's count of e is the popcount of the whole mask.
constexpr int kChunkWords = kBalancedChunkTokens / 32;
__global__ void balanced_rank_kernel(const int32_t* expert_ids, int64_t num_tokens, int top_k, int num_experts,
                                     int64_t tokens_per_source, int64_t chunks_per_source, int32_t* entry_rank,
                                     int32_t* chunk_counts) {
  __shared__ uint32_t mask[kMaxRouterExperts * kChunkWords];
  const int64_t source = blockIdx.x / chunks_per_source, chunk = blockIdx.x % chunks_per_source;
  const int64_t source_end = min((source + 1) * tokens_per_source, num_tokens);
  const int64_t t = source * tokens_per_source + chunk * kBalancedChunkTokens + threadIdx.x;
  const bool active = t < source_end;
  const int word = threadIdx.x / 32;
  const uint32_t bit = 1u << (threadIdx.x % 32);
  for (int i = threadIdx.x; i < num_experts * kChunkWords; i += blockDim.x) mask[i] = 0;
  __syncthreads();
  if (active) {
    for (int j = 0; j < top_k; ++j) atomicOr(&mask[expert_ids[t * top_k + j] * kChunkWords + word], bit);
  }
  __syncthreads();
  if (active) {
    for (int j = 0; j < top_k; ++j) {
      const uint32_t* m = mask + expert_ids[t * top_k + j] * kChunkWords;
      int rank = __popc(m[word] & (bit - 1));
      for (int w = 0; w < word; ++w) rank += __popc(m[w]);
      entry_rank[t * top_k + j] = rank;
    }
  }
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int count = 0;
    for (int w = 0; w < kChunkWords; ++w) count += __popc(mask[e * kChunkWords + w]);
    chunk_counts[static_cast<int64_t>(blockIdx.x) * num_experts + e] = count;
  }
}

// One thread per (source, expert): chunk counts -> exclusive bases in place, and the pair's total.
__global__ void balanced_scan_kernel(int32_t* chunk_base, int num_experts, int64_t chunks_per_source, int num_sources,
                                     int64_t sources_with_tokens, int32_t* counts) {
  const int64_t pair = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (pair >= static_cast<int64_t>(num_sources) * num_experts) return;
  const int64_t source = pair / num_experts, e = pair % num_experts;
  int32_t running = 0;
  if (source < sources_with_tokens) {
    for (int64_t c = 0; c < chunks_per_source; ++c) {
      int32_t& value = chunk_base[(source * chunks_per_source + c) * num_experts + e];
      const int32_t count = value;
      value = running;
      running += count;
    }
  }
  counts[pair] = running;
}

__global__ void balanced_pick_kernel(const int32_t* expert_ids, const int32_t* entry_rank, const int32_t* chunk_base,
                                     int64_t num_entries, int top_k, int num_experts, int64_t tokens_per_source,
                                     int64_t chunks_per_source, const int32_t* route_offsets,
                                     const int32_t* route_slots, const int32_t* route_ends, int32_t* slots) {
  for (int64_t entry = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; entry < num_entries;
       entry += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = entry / top_k, source = t / tokens_per_source;
    const int64_t chunk = (t - source * tokens_per_source) / kBalancedChunkTokens;
    const int e = expert_ids[entry];
    const int32_t index = chunk_base[(source * chunks_per_source + chunk) * num_experts + e] + entry_rank[entry];
    const int64_t pair = source * num_experts + e;
    int r = route_offsets[pair];
    const int last = route_offsets[pair + 1] - 1;
    while (r < last && route_ends[r] <= index) ++r;
    slots[entry] = route_slots[r];
  }
}

unsigned int blocks_for(int64_t n, int per_block) {
  const int64_t b = (n + per_block - 1) / per_block;
  return static_cast<unsigned int>(b < 1 ? 1 : (b > 65535 * 16 ? 65535 * 16 : b));
}

}  // namespace

cudaError_t launch_moe_router(const RouterArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  const size_t shared = args.histogram != nullptr ? sizeof(unsigned int) * args.num_experts : 0;
  const int per_block = args.num_tokens < kRouterSpreadBelowTokens ? kRouterWarps : kTokensPerRouterBlock;
  const auto blocks = static_cast<unsigned int>((args.num_tokens + per_block - 1) / per_block);
  return gpu::launch_dependent(moe_router_kernel, dim3(blocks), dim3(kRouterWarps * 32), shared, stream, args, per_block);
}

cudaError_t launch_dynamic_pick(const int32_t* expert_ids, const int32_t* draw_base, int64_t num_tokens, int top_k,
                                int64_t tokens_per_source, const uint64_t* source_streams,
                                const int32_t* replica_offsets, const int32_t* replica_slots, int32_t* slots,
                                cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  dynamic_pick_kernel<<<blocks_for(num_tokens, 128), 128, 0, stream>>>(
      expert_ids, draw_base, num_tokens, top_k, tokens_per_source, source_streams, replica_offsets, replica_slots, slots);
  return cudaGetLastError();
}

cudaError_t launch_balanced_counts(const int32_t* expert_ids, int64_t num_tokens, int top_k, int num_experts,
                                   int64_t tokens_per_source, int num_sources, int32_t* entry_rank,
                                   int32_t* chunk_base, int32_t* counts, cudaStream_t stream) {
  if (num_experts > kMaxRouterExperts) return cudaErrorInvalidValue;
  const int64_t chunks = balanced_chunks_per_source(tokens_per_source, num_tokens);
  const int64_t sources_with_tokens = (num_tokens + tokens_per_source - 1) / tokens_per_source;
  if (num_tokens > 0) {
    balanced_rank_kernel<<<static_cast<unsigned int>(sources_with_tokens * chunks), kBalancedChunkTokens, 0, stream>>>(
        expert_ids, num_tokens, top_k, num_experts, tokens_per_source, chunks, entry_rank, chunk_base);
  }
  const int64_t pairs = static_cast<int64_t>(num_sources) * num_experts;
  balanced_scan_kernel<<<static_cast<unsigned int>((pairs + 255) / 256), 256, 0, stream>>>(
      chunk_base, num_experts, chunks, num_sources, sources_with_tokens, counts);
  return cudaGetLastError();
}

cudaError_t launch_balanced_pick(const int32_t* expert_ids, const int32_t* entry_rank, const int32_t* chunk_base,
                                 int64_t num_tokens, int top_k, int num_experts, int64_t tokens_per_source,
                                 const int32_t* route_offsets, const int32_t* route_slots, const int32_t* route_ends,
                                 int32_t* slots, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int64_t num_entries = num_tokens * top_k;
  balanced_pick_kernel<<<blocks_for(num_entries, 256), 256, 0, stream>>>(
      expert_ids, entry_rank, chunk_base, num_entries, top_k, num_experts, tokens_per_source,
      balanced_chunks_per_source(tokens_per_source, num_tokens), route_offsets, route_slots, route_ends, slots);
  return cudaGetLastError();
}

cudaError_t launch_exclusive_scan(const int32_t* values, int64_t n, int32_t* out, int32_t* total, cudaStream_t stream) {
  exclusive_scan_kernel<<<1, 1024, 0, stream>>>(values, n, out, total);
  return cudaGetLastError();
}

cudaError_t launch_slot_counts(const int32_t* slots, int64_t num_entries, int num_slots, int32_t* slot_counts,
                               int32_t* offsets, cudaStream_t stream) {
  cudaError_t status = cudaMemsetAsync(slot_counts, 0, sizeof(int32_t) * num_slots, stream);
  if (status != cudaSuccess) return status;
  if (num_entries > 0) {
    slot_counts_kernel<<<blocks_for(num_entries, 256), 256, 0, stream>>>(slots, num_entries, slot_counts);
    if ((status = cudaGetLastError()) != cudaSuccess) return status;
  }
  return launch_exclusive_scan(slot_counts, num_slots, offsets, offsets + num_slots, stream);
}

cudaError_t launch_permute_rows(const uint16_t* x, int64_t num_tokens, int top_k, int hidden_size,
                                const int32_t* slots, int32_t* cursor, int32_t* entry_row, uint16_t* permuted,
                                cudaStream_t stream) {
  const int64_t num_entries = num_tokens * top_k;
  if (num_entries == 0) return cudaSuccess;
  permute_rows_kernel<<<blocks_for(num_entries, 8), 256, 0, stream>>>(x, num_entries, top_k, hidden_size, slots, cursor,
                                                                      entry_row, permuted);
  return cudaGetLastError();
}

cudaError_t launch_gather_rows(const uint16_t* x, const int32_t* row_token, int64_t num_rows, int hidden_size,
                               uint16_t* permuted, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  if (num_rows < 0 || hidden_size < 1 || x == nullptr || row_token == nullptr || permuted == nullptr) {
    return cudaErrorInvalidValue;
  }
  const bool vector = hidden_size % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(permuted) % 16 == 0;
  const auto kernel = vector ? gather_rows_kernel<true> : gather_rows_kernel<false>;
  return gpu::launch_dependent(kernel, dim3(blocks_for(num_rows, 8)), dim3(256), 0, stream, x, row_token, num_rows,
                               hidden_size, permuted);
}

cudaError_t launch_small_permutation(const int32_t* slots, int64_t num_entries, int top_k, int num_slots,
                                     int32_t* slot_counts, int32_t* offsets, int32_t* entry_row, int32_t* row_token,
                                     int32_t* active, cudaStream_t stream) {
  if (num_entries < 0 || num_entries > kSmallPlanMaxEntries || num_slots < 1 || num_slots > kSmallPlanMaxSlots ||
      top_k < 1) {
    return cudaErrorInvalidValue;
  }
  const size_t smem =
      sizeof(int32_t) * (static_cast<size_t>(plan_entry_slot_offset(num_slots)) + static_cast<size_t>(num_entries));
  cudaError_t status = cudaFuncSetAttribute(small_permutation_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem));
  if (status != cudaSuccess) return status;
  return gpu::launch_dependent(small_permutation_kernel, dim3(1), dim3(kSmallPlanThreads), smem, stream, slots,
                               static_cast<int>(num_entries), top_k, num_slots, slot_counts, offsets, entry_row,
                               row_token, active);
}

// FULCRUM_TINY_PLAN=0: the 1024-thread block for every small step; FULCRUM_WARP_PLAN=0: steps of at most 32
// entries permuted by the 128-thread block's scans instead of one warp (measurement; each read once).
static bool tiny_plan_enabled() {
  static const bool enabled = gpu::env_switch_on("FULCRUM_TINY_PLAN");
  return enabled;
}
static bool warp_plan_enabled() {
  static const bool enabled = gpu::env_switch_on("FULCRUM_WARP_PLAN");
  return enabled;
}

cudaError_t launch_small_route_permute(const RouterArgs& args, int num_slots, int32_t* slot_counts, int32_t* offsets,
                                      int32_t* entry_row, int32_t* row_token, int32_t* active, cudaStream_t stream) {
  const int64_t num_entries = args.num_tokens * args.top_k;
  if (args.static_slot_of == nullptr || args.num_tokens < 1 || num_entries > kSmallPlanMaxEntries || num_slots < 1 ||
      num_slots > kSmallPlanMaxSlots || args.top_k < 1 || args.num_experts > kMaxRouterExperts) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = sizeof(int32_t) * (static_cast<size_t>(plan_entry_slot_offset(num_slots)) +
                                         static_cast<size_t>(num_entries)) +
                      (args.histogram != nullptr ? sizeof(unsigned int) * args.num_experts : 0);
  const bool tiny = num_entries <= kTinyPlanThreads / 4 && tiny_plan_enabled();
  const auto kernel = !tiny                ? small_route_permute_kernel<kSmallPlanThreads, false>
                      : warp_plan_enabled() ? small_route_permute_kernel<kTinyPlanThreads, true>
                                            : small_route_permute_kernel<kTinyPlanThreads, false>;
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (status != cudaSuccess) return status;
  return gpu::launch_dependent(kernel, dim3(1), dim3(tiny ? kTinyPlanThreads : kSmallPlanThreads), smem, stream, args,
                               num_slots, slot_counts, offsets, entry_row, row_token, active);
}

cudaError_t launch_silu_mul_bf16(const uint16_t* h, int64_t num_rows, int intermediate_size, uint16_t* act,
                                 cudaStream_t stream) {
  const int64_t n = num_rows * intermediate_size;
  if (n == 0) return cudaSuccess;
  silu_mul_bf16_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(h, num_rows, intermediate_size, act);
  return cudaGetLastError();
}

cudaError_t launch_silu_mul_bf16_rows(const uint16_t* h, const int32_t* row_begin, const int32_t* row_end,
                                      int64_t max_rows, int intermediate_size, uint16_t* act, cudaStream_t stream) {
  const int64_t n = max_rows * intermediate_size;
  if (n == 0) return cudaSuccess;
  const bool aligned = reinterpret_cast<uintptr_t>(h) % 16 == 0 && reinterpret_cast<uintptr_t>(act) % 16 == 0;
  if (intermediate_size % 8 == 0 && aligned)
    return gpu::launch_dependent(silu_mul_bf16_rows_vec8_kernel, dim3(blocks_for(n / 8, 256)), dim3(256), 0, stream,
                                 h, row_begin, row_end, max_rows, intermediate_size, act);
  return gpu::launch_dependent(silu_mul_bf16_rows_kernel, dim3(blocks_for(n, 256)), dim3(256), 0, stream, h, row_begin,
                               row_end, max_rows, intermediate_size, act);
}

cudaError_t launch_fill_random_e4m3(uint8_t* out, int64_t n, uint64_t seed, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (n < 0 || out == nullptr) return cudaErrorInvalidValue;
  fill_random_e4m3_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(out, n, seed);
  return cudaGetLastError();
}

cudaError_t launch_fill_f32(float* out, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (n < 0 || out == nullptr) return cudaErrorInvalidValue;
  fill_f32_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(out, n, value);
  return cudaGetLastError();
}

cudaError_t launch_combine_f32(const uint16_t* rows, const int32_t* entry_row, const float* weights,
                               int64_t num_tokens, int top_k, int hidden_size, float* out, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  return gpu::launch_dependent(combine_kernel, dim3(blocks_for(num_tokens, 1)), dim3(256), 0, stream, rows, entry_row,
                               weights, num_tokens, top_k, hidden_size, out);
}

cudaError_t launch_fill_random_bf16(uint16_t* out, int64_t n, uint64_t seed, float scale, cudaStream_t stream,
                                    int64_t first_index) {
  if (n == 0) return cudaSuccess;
  fill_random_bf16_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(out, n, seed, scale, first_index);
  return cudaGetLastError();
}

}  // namespace fulcrum::cuda::moe
