// Top logprobs (sampler_top_logprobs.hpp): one 256-thread block per row. Pass 1: max (a block reduction).
// Pass 2: sum exp(logit - max) in double (thread-strided partial sums, then the block's). Then num_top rounds,
// each one pass over the row that finds the first token in (logit descending, id ascending) order after the
// previous round's pick: the selection is exact (comparisons only), only the sum differs from the CPU's
// sequential one in order (~V * 2^-53 relative).
#include "gpu/kernels/sampler_top_logprobs.hpp"

#include <climits>

#include <cuda_runtime.h>

namespace fulcrum::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTop = 20;

struct Pick {  // a token and its logit; id INT_MAX: none
  float x;
  int id;
};
__device__ __forceinline__ bool better(Pick a, Pick b) { return a.x > b.x || (a.x == b.x && a.id < b.id); }
// Whether token (x, id) comes after `prev` in the order (descending logit, ascending id).
__device__ __forceinline__ bool after(float x, int id, Pick prev) { return x < prev.x || (x == prev.x && id > prev.id); }

__device__ Pick block_best(Pick p, Pick* warp_slots) {
  for (int off = 16; off > 0; off >>= 1) {
    const Pick o{__shfl_xor_sync(0xffffffffu, p.x, off), __shfl_xor_sync(0xffffffffu, p.id, off)};
    if (better(o, p)) p = o;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // the slots' previous use is over
  if (lane == 0) warp_slots[warp] = p;
  __syncthreads();
  Pick best = warp_slots[0];
  for (int w = 1; w < kWarps; ++w) {
    if (better(warp_slots[w], best)) best = warp_slots[w];
  }
  return best;
}

__device__ double block_sum(double v, double* warp_slots) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) warp_slots[warp] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kWarps; ++w) total += warp_slots[w];  // the same order in every thread
  return total;
}

__global__ void __launch_bounds__(kThreads)
    top_logprobs_kernel(const float* __restrict__ logits, int64_t row_stride, int vocab, int num_top,
                        const int32_t* __restrict__ tokens, float* __restrict__ token_logprobs,
                        int32_t* __restrict__ top_ids, float* __restrict__ top_logprobs) {
  __shared__ Pick pick_slots[kWarps];
  __shared__ double sum_slots[kWarps];
  const int r = blockIdx.x;
  const float* row = logits + r * row_stride;
  const int token = tokens[r];
  int32_t* ids_out = top_ids + (int64_t)r * num_top;
  float* lp_out = top_logprobs + (int64_t)r * num_top;
  if (token < 0 || token >= vocab) {  // the sampler refused the row: nothing to report
    for (int j = threadIdx.x; j < num_top; j += kThreads) ids_out[j] = -1, lp_out[j] = NAN;
    if (threadIdx.x == 0) token_logprobs[r] = NAN;
    return;
  }
  Pick mine{-INFINITY, INT_MAX};
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    if (better(Pick{row[i], i}, mine)) mine = Pick{row[i], i};
  }
  const Pick top = block_best(mine, pick_slots);
  const double vmax = (double)top.x;
  double part = 0.0;
  for (int i = threadIdx.x; i < vocab; i += kThreads) part += exp((double)row[i] - vmax);
  const double log_sum = log(block_sum(part, sum_slots));
  const auto value = [&](float x) { return (float)((double)x - vmax - log_sum); };
  if (threadIdx.x == 0) token_logprobs[r] = value(row[token]);
  Pick prev = top;
  for (int j = 0; j < num_top; ++j) {
    if (j > 0) {
      Pick cand{-INFINITY, INT_MAX};
      for (int i = threadIdx.x; i < vocab; i += kThreads) {
        const float x = row[i];
        if (after(x, i, prev) && better(Pick{x, i}, cand)) cand = Pick{x, i};
      }
      prev = block_best(cand, pick_slots);
    }
    if (threadIdx.x == 0) {
      const bool found = prev.id != INT_MAX;
      ids_out[j] = found ? prev.id : -1;
      lp_out[j] = found ? value(prev.x) : NAN;
    }
  }
}

}  // namespace

int launch_top_logprobs(const float* logits, int64_t logits_row_stride, int num_rows, int vocab_size, int num_top,
                        const int32_t* tokens, float* token_logprobs, int32_t* top_ids, float* top_logprobs,
                        CUstream_st* stream) {
  if (num_rows == 0) return cudaSuccess;
  if (num_rows < 0 || vocab_size < 1 || logits_row_stride < vocab_size || num_top < 1 || num_top > kMaxTop ||
      !logits || !tokens || !token_logprobs || !top_ids || !top_logprobs) {
    return cudaErrorInvalidValue;
  }
  top_logprobs_kernel<<<num_rows, kThreads, 0, stream>>>(logits, logits_row_stride, vocab_size, num_top, tokens,
                                                         token_logprobs, top_ids, top_logprobs);
  return cudaGetLastError();
}

}  // namespace fulcrum::gpu
