// Device sampling (sampler.hpp): every sum runs in an order fixed by the row, the vocabulary size and whether the
// call has fewer than kSplitBelowRows rows.
//
// Pass A reads the row once: NaN / +inf check, count of finite logits, max and argmax (lowest id), min finite
// logit, and for logprobs an online log-sum-exp (fp32 exponentials, double sum). For fewer than kSplitBelowRows
// rows it runs split: a block per kStatsChunk logits of a row (row_stats_kernel), the partial stats merged in split
// order by the row's 512-thread block (sample_kernel) — one block reading a 152k-token row alone took 59 us of a
// 3.2 ms decode step at batch 1 (bench/results/decode_kernel_profile_b1_b16_14568e6_h200.txt), latency-bound;
// with more rows, one block a row. Greedy rows end there.
//
// Sampling rows sort at most 2048 tokens, never the vocabulary. The definition's order (descending logit, lower
// id first) is ascending order of the 64-bit entry (~key(logit) << 32) | id, key() being the order-preserving map
// of a float's bits. Its three cuts are each a select, "the first token in that order at which a running count /
// weight meets a threshold": the top_k-th token (count >= k), the nucleus end (weight >= top_p * total) and the
// draw (weight > uniform * nucleus mass). A select histograms the candidates into 1024 bins linear in
// max - logit (one pass over the row; weights are exp in double, bins get shared-memory atomics), scans the bins
// to find the bin where the threshold is met, gathers that bin's tokens (or every token up to it, when that
// fits) into shared memory, sorts them (bitonic) and scans their weights in order. A bin too large to gather is
// refined by radix bins over its key range (at most 4 levels) down to one logit value, whose tokens (of equal
// weight) are told apart by id with a block scan over id chunks. A kept set of <= 2048 tokens (small top_k,
// small vocabularies) is gathered whole and sampled in shared memory like the definition does.
//
// Sums differ from the CPU's sequential double sums only in order (and in the terms its running sum absorbs),
// so a token can differ only when the target lies within ~V * 2^-53 of a boundary; see gpu_sampler_test.cpp.
#include "gpu/kernels/sampler.hpp"

#include <cfloat>
#include <climits>

#include <cuda_runtime.h>

#include "gpu/kernels/block_primitives.cuh"
#include "gpu/kernels/dependent_launch.cuh"

namespace fulcrum::gpu {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBinBits = 10;
constexpr int kBins = 1 << kBinBits;  // bins of one select level: two per thread in choose_bin
constexpr int kListCap = 2048;        // tokens sorted in shared memory
static_assert(kBins == 2 * kThreads, "choose_bin gives each thread two bins");
constexpr int kStatsThreads = 256;
constexpr int kSplitBelowRows = 128;  // pass A runs split for fewer rows than this (measured: launch_sample)
constexpr int kStatsChunk = 4096;  // logits per pass-A block: 16 a thread, one trip of 16-byte loads; a multiple of
                                   // 4, so a row's 16-byte alignment holds for every chunk

struct RowStats {  // plain (no initializers): an array of them lives in shared memory
  float vmax;      // max finite logit, also the log-sum-exp's reference point
  int argmax;      // lowest id holding vmax
  float vmin;      // min finite logit
  int num_finite;
  int bad;         // a NaN or +inf seen
  double lse_sum;  // sum exp(logit - vmax)
};

struct Shared {
  uint32_t count[kBins];
  double mass[kBins];
  uint64_t list[kListCap];  // entries, sorted ascending = the definition's order
  double cum[kListCap];     // inclusive prefix weight along the sorted list
  double warp_d[kWarps];
  RowStats warp_stats[kWarps];
  double pick_d[3];
  int list_size, result_i;
  uint32_t result_lo, result_hi;
};

// Row-uniform context of the sampling passes.
struct RowCtx {
  const float* logits;
  int vocab;
  float vmax, bin_scale;  // level-0 bin of x: (vmax - x) * bin_scale
  double inv_t;
  uint32_t kept_key;  // top-k cut: kept iff key > kept_key, or key == kept_key and id <= kept_id
  int kept_id;
};

__device__ __forceinline__ uint32_t key_of(float x) {
  const uint32_t b = __float_as_uint(x == 0.0f ? 0.0f : x);  // -0 ties with +0, as the definition compares
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float value_of(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}
__device__ __forceinline__ uint64_t entry_of(uint32_t key, int id) { return (uint64_t)(~key) << 32 | (uint32_t)id; }
__device__ __forceinline__ uint32_t entry_key(uint64_t e) { return ~(uint32_t)(e >> 32); }
__device__ __forceinline__ int entry_id(uint64_t e) { return (int)(uint32_t)e; }

__device__ __forceinline__ bool candidate(const RowCtx& c, float x, uint32_t key, int i) {
  return x != -INFINITY && (key > c.kept_key || (key == c.kept_key && i <= c.kept_id));
}
// Monotone in x (rounded float ops are), so equal logits share a bin and bins follow the definition's order.
__device__ __forceinline__ int value_bin(const RowCtx& c, float x) {
  const float t = __fmul_rn(__fsub_rn(c.vmax, x), c.bin_scale);
  return t < (float)kBins ? (int)t : kBins - 1;
}
// The definition's weight: exp((logit - max) / temperature) in double.
__device__ __forceinline__ double weight(const RowCtx& c, float x) {
  return exp(__dmul_rn(__dsub_rn((double)x, (double)c.vmax), c.inv_t));
}
__device__ __forceinline__ double entry_weight(const RowCtx& c, uint64_t e, bool mass_mode) {
  return mass_mode ? weight(c, value_of(entry_key(e))) : 1.0;
}
__device__ __forceinline__ bool meets(double cum, double tau, bool strict) { return strict ? cum > tau : cum >= tau; }

// Which candidates a pass looks at.
enum ScopeKind { kAll, kBinUpTo, kBinIs, kKeyRange };
struct Scope {
  ScopeKind kind;
  int bin = 0;                // level-0 bin (kBinUpTo, kBinIs)
  uint32_t klo = 0, khi = 0;  // kKeyRange, inclusive
};
__device__ __forceinline__ bool in_scope(const Scope& s, const RowCtx& c, float x, uint32_t key) {
  if (s.kind == kAll) return true;
  if (s.kind == kKeyRange) return key >= s.klo && key <= s.khi;
  return s.kind == kBinUpTo ? value_bin(c, x) <= s.bin : value_bin(c, x) == s.bin;
}

__device__ void merge(RowStats& a, const RowStats& b) {
  if (b.vmax > -INFINITY) {  // log-sum-exp first: it needs both maxima
    if (a.vmax == -INFINITY) a.lse_sum = b.lse_sum;
    else if (b.vmax > a.vmax) a.lse_sum = b.lse_sum + a.lse_sum * exp((double)a.vmax - (double)b.vmax);
    else a.lse_sum += b.lse_sum * exp((double)b.vmax - (double)a.vmax);
  }
  if (b.vmax > a.vmax || (b.vmax == a.vmax && b.argmax < a.argmax)) a.vmax = b.vmax, a.argmax = b.argmax;
  a.vmin = fminf(a.vmin, b.vmin);
  a.num_finite += b.num_finite;
  a.bad |= b.bad;
}

// Pass A over row[0, n), ids base + i: one thread's share of a kStatsThreads block.
__device__ RowStats thread_stats(const float* row, int n, int base, bool want_lse) {
  RowStats st{-INFINITY, INT_MAX, INFINITY, 0, 0, 0.0};
  block::for_each_float<kStatsThreads, kStatsChunk / (4 * kStatsThreads)>(row, n, [&](int i, float x) {
    i += base;
    if (!(x < INFINITY)) st.bad = 1;         // NaN or +inf
    if (!(x > -INFINITY && x < INFINITY)) return;  // not finite
    ++st.num_finite;
    st.vmin = fminf(st.vmin, x);
    if (x > st.vmax) {
      if (want_lse) st.lse_sum = st.lse_sum * exp((double)st.vmax - (double)x) + 1.0;
      st.vmax = x, st.argmax = i;
    } else {
      if (x == st.vmax && i < st.argmax) st.argmax = i;
      if (want_lse) st.lse_sum += (double)expf(x - st.vmax);
    }
  });
  return st;
}

// The block's threads' stats merged in a fixed order (lanes by butterfly, then warps in order); every thread
// gets the result. warp_stats: shared [kT / 32].
template <int kT>
__device__ RowStats block_stats(RowStats* warp_stats, RowStats st) {
  for (int o = 16; o > 0; o >>= 1) {
    RowStats other;
    other.vmax = __shfl_xor_sync(~0u, st.vmax, o), other.argmax = __shfl_xor_sync(~0u, st.argmax, o);
    other.vmin = __shfl_xor_sync(~0u, st.vmin, o), other.num_finite = __shfl_xor_sync(~0u, st.num_finite, o);
    other.bad = __shfl_xor_sync(~0u, st.bad, o), other.lse_sum = __shfl_xor_sync(~0u, st.lse_sum, o);
    merge(st, other);
  }
  if ((threadIdx.x & 31) == 0) warp_stats[threadIdx.x >> 5] = st;
  __syncthreads();
  RowStats all = warp_stats[0];
  for (int w = 1; w < kT / 32; ++w) merge(all, warp_stats[w]);
  return all;
}

int stats_splits(int vocab) { return (vocab + kStatsChunk - 1) / kStatsChunk; }

// Whether pass A runs split (FULCRUM_SAMPLER_SPLIT=0: one block a row, for measurement; read once).
bool sampler_split_enabled() {
  static const bool enabled = env_switch_on("FULCRUM_SAMPLER_SPLIT");
  return enabled;
}

// Pass A, split: block (row, split) writes the stats of logits [split * chunk, +chunk) of its row (chunk a
// multiple of 4: kStatsChunk, or the whole row when unsplit). Rows on x: a call may have more than 65535.
__global__ void __launch_bounds__(kStatsThreads) row_stats_kernel(const float* logits, int64_t row_stride,
                                                                  int vocab, int chunk, bool want_lse,
                                                                  RowStats* __restrict__ out) {
  wait_then_release();  // dependent_launch.cuh: the logits come from the kernel before
  __shared__ RowStats warp_stats[kStatsThreads / 32];
  const int r = blockIdx.x, split = blockIdx.y;
  const int begin = split * chunk, n = min(vocab - begin, chunk);
  const RowStats st =
      block_stats<kStatsThreads>(warp_stats, thread_stats(logits + r * row_stride + begin, n, begin, want_lse));
  if (threadIdx.x == 0) out[(int64_t)r * gridDim.y + split] = st;
}

// ---- select machinery ----
// Histogram of the candidates in `scope`: level-0 value bins (shift < 0) or (khi - key) >> shift.
__device__ void histogram(Shared& s, const RowCtx& c, const Scope& scope, int shift, bool mass_mode) {
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kThreads) s.count[b] = 0, s.mass[b] = 0.0;
  __syncthreads();
  block::for_each_float<kThreads, 2>(c.logits, c.vocab, [&](int i, float x) {
    const uint32_t key = key_of(x);
    if (!candidate(c, x, key, i) || !in_scope(scope, c, x, key)) return;
    const int b = shift < 0 ? value_bin(c, x) : (int)((scope.khi - key) >> shift);
    atomicAdd(&s.count[b], 1u);
    if (mass_mode) atomicAdd(&s.mass[b], weight(c, x));
  });
  __syncthreads();
}

struct BinPick {
  int bin;
  double above, above_count, count;  // weight / count before the bin (including `above`), tokens in it
};
// The first bin at which above + the bins' running weight (count in count mode) meets tau.
__device__ BinPick choose_bin(Shared& s, bool mass_mode, double above, double above_count, double tau, bool strict) {
  const int b = 2 * threadIdx.x;
  const double c0 = s.count[b], c1 = s.count[b + 1];
  const double q0 = mass_mode ? s.mass[b] : c0, q1 = mass_mode ? s.mass[b + 1] : c1;
  double unused;
  const double q_before = above + block::exclusive_scan<kThreads>(s.warp_d, q0 + q1, &unused);
  const double c_before = above_count + block::exclusive_scan<kThreads>(s.warp_d, c0 + c1, &unused);
  int first = INT_MAX;
  if (meets(q_before + q0, tau, strict)) first = b;
  else if (meets(q_before + q0 + q1, tau, strict)) first = b + 1;
  int bin = block::min_of<kThreads>(&s.result_i, first);
  if (bin == INT_MAX) {  // rounding left tau above the bins' total: the last bin with weight
    bin = max(0, block::max_of<kThreads>(&s.result_i, q1 > 0.0 ? b + 1 : (q0 > 0.0 ? b : -1)));
  }
  if (bin == b || bin == b + 1) {
    const bool second = bin == b + 1;
    s.pick_d[0] = second ? q_before + q0 : q_before;
    s.pick_d[1] = second ? c_before + c0 : c_before;
    s.pick_d[2] = second ? c1 : c0;
  }
  __syncthreads();
  const BinPick pick{bin, s.pick_d[0], s.pick_d[1], s.pick_d[2]};
  __syncthreads();
  return pick;
}

// Candidates in scope -> s.list (unordered); returns how many (the caller checked they fit).
__device__ int gather(Shared& s, const RowCtx& c, const Scope& scope) {
  __syncthreads();
  if (threadIdx.x == 0) s.list_size = 0;
  __syncthreads();
  block::for_each_float<kThreads, 4>(c.logits, c.vocab, [&](int i, float x) {
    const uint32_t key = key_of(x);
    if (!candidate(c, x, key, i) || !in_scope(scope, c, x, key)) return;
    const int slot = atomicAdd(&s.list_size, 1);
    if (slot < kListCap) s.list[slot] = entry_of(key, i);
  });
  __syncthreads();
  return min(s.list_size, kListCap);
}

// s.cum[i] = weight (count) of list[0..i]: each thread sums a run of consecutive entries, then a block scan.
__device__ void scan_list(Shared& s, const RowCtx& c, int n, bool mass_mode) {
  const int per = (n + kThreads - 1) / kThreads;
  const int lo = min(n, (int)threadIdx.x * per), hi = min(n, lo + per);
  __syncthreads();
  double run = 0.0;
  for (int i = lo; i < hi; ++i) s.cum[i] = run += entry_weight(c, s.list[i], mass_mode);
  double unused;
  const double before = block::exclusive_scan<kThreads>(s.warp_d, run, &unused);
  for (int i = lo; i < hi; ++i) s.cum[i] = before + s.cum[i];
  __syncthreads();
}
__device__ int find_first(Shared& s, int n, double above, double tau, bool strict) {  // -1: none
  int first = INT_MAX;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    if (meets(above + s.cum[i], tau, strict)) first = i;
    if (first != INT_MAX) break;
  }
  first = block::min_of<kThreads>(&s.result_i, first);
  return first == INT_MAX ? -1 : first;
}
__device__ int last_above(Shared& s, const RowCtx& c, int n, double h, bool mass_mode) {  // -1: none
  int last = -1;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    if (entry_weight(c, s.list[i], mass_mode) > h) last = i;
  }
  return block::max_of<kThreads>(&s.result_i, last);
}

struct Pick {
  uint32_t key;
  int id;
  int index;   // in s.list; -1 for a pick among tied logits
  double cum;  // running weight (count) through the pick
};
__device__ Pick finish_in_list(Shared& s, const RowCtx& c, int n, double above, double tau, bool strict,
                               bool mass_mode) {
  block::bitonic_sort<kThreads>(s.list, n);
  scan_list(s, c, n, mass_mode);
  int i = find_first(s, n, above, tau, strict);
  if (i < 0) i = last_above(s, c, n, 0.0, mass_mode);  // rounding left tau past the bin: last with weight
  if (i < 0) i = n - 1;
  return Pick{entry_key(s.list[i]), entry_id(s.list[i]), i, above + s.cum[i]};
}

// Min / max key of the candidates in scope.
__device__ void key_range(Shared& s, const RowCtx& c, const Scope& scope, uint32_t* klo, uint32_t* khi) {
  __syncthreads();
  if (threadIdx.x == 0) s.result_lo = UINT_MAX, s.result_hi = 0;
  __syncthreads();
  uint32_t lo = UINT_MAX, hi = 0;
  block::for_each_float<kThreads, 4>(c.logits, c.vocab, [&](int i, float x) {
    const uint32_t key = key_of(x);
    if (candidate(c, x, key, i) && in_scope(scope, c, x, key)) lo = min(lo, key), hi = max(hi, key);
  });
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(~0u, lo, o)), hi = max(hi, __shfl_xor_sync(~0u, hi, o));
  }
  if ((threadIdx.x & 31) == 0) atomicMin(&s.result_lo, lo), atomicMax(&s.result_hi, hi);
  __syncthreads();
  *klo = s.result_lo, *khi = s.result_hi;
}

// num_tied candidates share `key` (one logit, one weight w); the pick is the j-th of them in id order, j the
// first index at which above + (j + 1) * w meets tau. Threads own consecutive id chunks; a block scan of their
// counts finds the chunk holding the j-th.
__device__ Pick tie_pick(Shared& s, const RowCtx& c, uint32_t key, double above, double num_tied, double tau,
                         bool strict, bool mass_mode) {
  const double w = mass_mode ? weight(c, value_of(key)) : 1.0;
  const double q = w > 0.0 ? (tau - above) / w : num_tied;
  const int j = (int)fmin(fmax(strict ? floor(q) : ceil(q) - 1.0, 0.0), num_tied - 1.0);
  const int chunk = (c.vocab + kThreads - 1) / kThreads;
  const int lo = min(c.vocab, (int)threadIdx.x * chunk), hi = min(c.vocab, lo + chunk);
  const auto tied = [&](int i) {
    const float x = c.logits[i];
    return key_of(x) == key && candidate(c, x, key, i);
  };
  int n = 0;
  for (int i = lo; i < hi; ++i) n += tied(i);
  double unused;
  const int before = (int)block::exclusive_scan<kThreads>(s.warp_d, (double)n, &unused);
  if (threadIdx.x == 0) s.result_i = -1;
  __syncthreads();
  if (before <= j && j < before + n) {
    int left = j - before;
    for (int i = lo; i < hi; ++i) {
      if (tied(i) && left-- == 0) {
        s.result_i = i;
        break;
      }
    }
  }
  __syncthreads();
  const int id = s.result_i;
  __syncthreads();
  return Pick{key, id, -1, above + (j + 1) * w};
}

// The first candidate in the definition's order at which the running weight (count) meets tau. Expects the
// level-0 histogram in s. *whole: s.list / s.cum then hold every candidate from the first through the pick.
__device__ Pick select(Shared& s, const RowCtx& c, bool mass_mode, double tau, bool strict, bool* whole) {
  BinPick b = choose_bin(s, mass_mode, 0.0, 0.0, tau, strict);
  *whole = b.above_count + b.count <= kListCap;
  if (*whole) return finish_in_list(s, c, gather(s, c, {kBinUpTo, b.bin}), 0.0, tau, strict, mass_mode);
  if (b.count <= kListCap) return finish_in_list(s, c, gather(s, c, {kBinIs, b.bin}), b.above, tau, strict, mass_mode);
  uint32_t klo, khi;
  key_range(s, c, {kBinIs, b.bin}, &klo, &khi);
  while (klo != khi) {  // radix bins over the key range: each level cuts its bit length by kBinBits
    const int shift = max(0, 32 - __clz((int)(khi - klo)) - kBinBits);
    const Scope range{kKeyRange, 0, klo, khi};
    histogram(s, c, range, shift, mass_mode);
    b = choose_bin(s, mass_mode, b.above, b.above_count, tau, strict);
    klo = (uint32_t)max((int64_t)klo, (int64_t)khi - (((int64_t)b.bin + 1) << shift) + 1);
    khi -= (uint32_t)b.bin << shift;
    if (b.count <= kListCap) {
      return finish_in_list(s, c, gather(s, c, {kKeyRange, 0, klo, khi}), b.above, tau, strict, mass_mode);
    }
  }
  return tie_pick(s, c, klo, b.above, b.count, tau, strict, mass_mode);
}

__device__ int count_above(Shared& s, const RowCtx& c, double h) {  // candidates with weight > h
  int n = 0;
  block::for_each_float<kThreads, 2>(c.logits, c.vocab,
                                     [&](int i, float x) { n += candidate(c, x, key_of(x), i) && weight(c, x) > h; });
  double total;
  block::exclusive_scan<kThreads>(s.warp_d, (double)n, &total);
  return (int)total;
}

// uniform = 1 - 2^-53 (any target within one ulp below the mass): the CPU's running sum then stops at the last
// token it still took in, the last one whose weight exceeds half an ulp of the mass; other orders of summation
// would not, so the rule is applied explicitly.
__device__ bool at_top_edge(double target, double mass) { return target >= nextafter(mass, 0.0); }
__device__ double half_ulp(double mass) {
  int e;
  frexp(mass, &e);  // mass in [2^(e-1), 2^e)
  return ldexp(1.0, e - 54);
}

// The draw over list[0, n) (the nucleus, scanned): first running weight > uniform * mass.
__device__ int draw_in_list(Shared& s, const RowCtx& c, int n, double mass, double uniform) {
  const double target = uniform * mass;
  int i;
  if (at_top_edge(target, mass)) {
    i = last_above(s, c, n, half_ulp(mass), true);
  } else {
    i = find_first(s, n, 0.0, target, true);
    if (i < 0) i = last_above(s, c, n, 0.0, true);  // rounding left the target at the top
  }
  return entry_id(s.list[max(i, 0)]);
}
// The whole kept set is list[0, n), sorted: the definition's steps, in shared memory.
__device__ int sample_in_list(Shared& s, const RowCtx& c, int n, const SamplerRow& p) {
  scan_list(s, c, n, true);
  int end = n - 1;
  if (p.top_p < 1.0f) {
    const int e = find_first(s, n, 0.0, (double)p.top_p * s.cum[n - 1], false);
    if (e >= 0) end = e;
  }
  return draw_in_list(s, c, end + 1, s.cum[end], p.uniform);
}

__device__ int sample_row(Shared& s, RowCtx& c, const SamplerRow& p, int num_finite, double* ws_mass,
                          uint32_t* ws_count) {
  const int k = p.top_k > 0 && p.top_k < c.vocab ? p.top_k : c.vocab;
  int num_kept = num_finite;  // finite kept tokens (-inf ones weigh 0: never drawn)
  bool whole;
  if (k < num_finite) {  // the top-k cut: the k-th token in order
    histogram(s, c, {kAll}, -1, false);
    const Pick cut = select(s, c, false, (double)k, false, &whole);
    if (whole) return sample_in_list(s, c, k, p);
    c.kept_key = cut.key, c.kept_id = cut.id, num_kept = k;
  }
  if (num_kept <= kListCap) {
    const int n = gather(s, c, {kAll});
    block::bitonic_sort<kThreads>(s.list, n);
    return sample_in_list(s, c, n, p);
  }
  histogram(s, c, {kAll}, -1, true);  // level 0 of the weight selects, kept for the draw
  for (int b = threadIdx.x; b < kBins; b += kThreads) ws_mass[b] = s.mass[b], ws_count[b] = s.count[b];
  double mass;  // the total, summed as choose_bin sums it
  block::exclusive_scan<kThreads>(s.warp_d, s.mass[2 * threadIdx.x] + s.mass[2 * threadIdx.x + 1], &mass);
  if (p.top_p < 1.0f) {
    const Pick end = select(s, c, true, (double)p.top_p * mass, false, &whole);
    mass = end.cum;
    if (whole) return draw_in_list(s, c, end.index + 1, mass, p.uniform);
    if (at_top_edge(p.uniform * mass, mass)) return end.id;  // the nucleus end always moves the running sum
    __syncthreads();
    for (int b = threadIdx.x; b < kBins; b += kThreads) s.mass[b] = ws_mass[b], s.count[b] = ws_count[b];
    __syncthreads();
  } else if (at_top_edge(p.uniform * mass, mass)) {  // the last token with weight > half an ulp, by count
    const int rank = count_above(s, c, half_ulp(mass));
    histogram(s, c, {kAll}, -1, false);
    return select(s, c, false, (double)rank, false, &whole).id;
  }
  return select(s, c, true, p.uniform * mass, true, &whole).id;
}

__global__ void __launch_bounds__(kThreads, 2)
    sample_kernel(const float* logits, int64_t row_stride, int vocab, const SamplerRow* __restrict__ rows,
                  int32_t* __restrict__ tokens, float* __restrict__ logprobs, double* ws_mass, uint32_t* ws_count,
                  const RowStats* partials, int splits) {
  wait_then_release();  // dependent_launch.cuh: the partial stats come from the kernel before
  __shared__ Shared s;
  const int r = blockIdx.x;
  const float* row = logits + r * row_stride;
  const SamplerRow p = rows[r];
  RowStats mine{-INFINITY, INT_MAX, INFINITY, 0, 0, 0.0};
  if ((int)threadIdx.x < splits) mine = partials[(int64_t)r * splits + threadIdx.x];
  const RowStats st = block_stats<kThreads>(s.warp_stats, mine);
  const bool params_ok = isfinite(p.temperature) && p.temperature >= 0.0f && p.top_p > 0.0f && p.top_p <= 1.0f &&
                         p.top_k >= 0 && p.uniform >= 0.0 && p.uniform < 1.0;
  int token = -1;
  if (params_ok && !st.bad && st.num_finite > 0) {
    if (p.temperature == 0.0f) {
      token = st.argmax;
    } else {
      const double range = (double)st.vmax - (double)st.vmin;
      const float bin_scale = range > 0.0 ? (float)fmin(kBins / range, (double)FLT_MAX) : 0.0f;
      RowCtx c{row, vocab, st.vmax, bin_scale, 1.0 / (double)p.temperature, 0u, INT_MAX};
      token = sample_row(s, c, p, st.num_finite, ws_mass + (size_t)r * kBins, ws_count + (size_t)r * kBins);
    }
  }
  if (threadIdx.x == 0) {
    tokens[r] = token;
    if (logprobs) logprobs[r] = token < 0 ? NAN : (float)((double)row[token] - (double)st.vmax - log(st.lse_sum));
  }
}

}  // namespace

size_t sampler_workspace_bytes(int max_rows, int vocab_size) {
  const size_t rows = max_rows > 0 ? max_rows : 0, splits = vocab_size > 0 ? stats_splits(vocab_size) : 0;
  return rows * kBins * (sizeof(double) + sizeof(uint32_t)) + rows * splits * sizeof(RowStats);
}

int launch_sample(const float* logits, int64_t logits_row_stride, int num_rows, int vocab_size, const SamplerRow* rows,
                  int32_t* tokens, float* logprobs, void* workspace, size_t workspace_bytes, CUstream_st* stream) {
  if (num_rows == 0) return cudaSuccess;
  if (num_rows < 0 || vocab_size < 1 || stats_splits(vocab_size) > kThreads || logits_row_stride < vocab_size ||
      !logits || !rows || !tokens || !workspace || reinterpret_cast<uintptr_t>(workspace) % 16 != 0 ||
      workspace_bytes < sampler_workspace_bytes(num_rows, vocab_size)) {
    return cudaErrorInvalidValue;
  }
  // Split below 128 rows: GpuSamplerTest.PrintsTimings at fc86ebe (greedy with logprobs, V 151936) took 15.7 /
  // 71.0 / 237.2 us split against 97.1 / 103.4 / 118.0 us with a block a row at 1 / 64 / 256 rows. The split
  // changes only the rounding of a logprob's log-sum-exp, never a token (max, argmax, min and counts are exact).
  const bool split = sampler_split_enabled() && num_rows < kSplitBelowRows;
  const int splits = split ? stats_splits(vocab_size) : 1;
  double* ws_mass = static_cast<double*>(workspace);                                     // [num_rows, kBins]
  uint32_t* ws_count = reinterpret_cast<uint32_t*>(ws_mass + (size_t)num_rows * kBins);  // [num_rows, kBins]
  // [num_rows, splits]; 8-byte aligned (a row's counts are 4 KiB)
  RowStats* partials = reinterpret_cast<RowStats*>(ws_count + (size_t)num_rows * kBins);
  const cudaError_t status =
      launch_dependent(row_stats_kernel, dim3(num_rows, splits), dim3(kStatsThreads), 0, stream, logits,
                       logits_row_stride, vocab_size, split ? kStatsChunk : vocab_size, logprobs != nullptr, partials);
  if (status != cudaSuccess) return status;
  return launch_dependent(sample_kernel, dim3(num_rows), dim3(kThreads), 0, stream, logits, logits_row_stride,
                          vocab_size, rows, tokens, logprobs, ws_mass, ws_count, static_cast<const RowStats*>(partials),
                          splits);
}

}  // namespace fulcrum::gpu
