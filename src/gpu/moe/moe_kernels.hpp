#pragma once
// Kernels of the GPU MoE layer (moe_kernels.cu), as raw-pointer launchers on a stream that return the
// launch status. bf16 tensors are passed as uint16_t bit patterns (the .cu side reads them as
// __nv_bfloat16). Entries are [num_tokens * top_k], entry t*top_k+j being token t's j-th choice in
// descending probability. CPU reference of each: src/model/moe_reference.hpp.
#include <cstdint>

#include <cuda_runtime.h>

namespace fulcrum::cuda::moe {

constexpr int kMaxRouterExperts = 256;  // the router keeps E / 32 logits per lane in registers
constexpr int kMaxTopK = 16;

// Router arguments (device pointers). Token t comes from source t / tokens_per_source.
struct RouterArgs {
  const float* logits = nullptr;           // [T, E]
  int64_t num_tokens = 0;
  int num_experts = 0;                     // <= kMaxRouterExperts
  int top_k = 0;                           // <= kMaxTopK
  bool norm_topk_prob = true;
  int64_t tokens_per_source = 1;
  const int32_t* static_slot_of = nullptr;  // static dispatch: [num_sources][E]; null otherwise
  const int32_t* replica_offsets = nullptr; // dynamic: [E + 1]
  int32_t* expert_ids = nullptr;           // out [T * k]
  float* weights = nullptr;                // out [T * k]
  int32_t* slots = nullptr;                // out [T * k] (static: here; else launch_dynamic_pick / _balanced_pick)
  int32_t* multi_draws = nullptr;          // dynamic out [T]: entries of the token with >= 2 replicas
  unsigned long long* histogram = nullptr; // recorder row [E] (+= counts); null: no recording
};

// Softmax (double exponentials and sum, fp32 probabilities, as CpuBackend::route), top-k by k warp-wide
// argmax rounds (ties to the lower expert), renormalization in fp32 in j order, static replica lookup,
// and the recorder's histogram (per-block shared counts, then one global atomicAdd per expert and block).
cudaError_t launch_moe_router(const RouterArgs& args, cudaStream_t stream);

// Dynamic replica choice after launch_moe_router: draw_base [T] is the exclusive prefix sum of
// multi_draws; a token's entries, visited in ascending expert order, take SplitMix64 draws number
// draw_base[t] - draw_base[first token of its source] + i of the source's stream (eplb::DynamicDispatcher).
cudaError_t launch_dynamic_pick(const int32_t* expert_ids, const int32_t* draw_base, int64_t num_tokens, int top_k,
                                int64_t tokens_per_source, const uint64_t* source_streams,
                                const int32_t* replica_offsets, const int32_t* replica_slots, int32_t* slots,
                                cudaStream_t stream);

// Balanced replica choice after launch_moe_router, in two launches around the host's BalancedSplitter.
// Each source's tokens are cut into chunks of kBalancedChunkTokens; an entry's index among its (source,
// expert) entries in token order is chunk_base[source][chunk][expert] + entry_rank[entry], both computed
// without atomics whose order could vary (a per-chunk bitmask per expert, popcounts, a scan over chunks).
constexpr int kBalancedChunkTokens = 256;
inline int64_t balanced_chunks_per_source(int64_t tokens_per_source, int64_t num_tokens) {
  const int64_t n = tokens_per_source < num_tokens ? tokens_per_source : num_tokens;
  return (n + kBalancedChunkTokens - 1) / kBalancedChunkTokens;
}
// -> entry_rank [T * k], chunk_base [num_sources][chunks per source][E], counts [num_sources][E] (entries of
// each (source, expert); 0 for sources without tokens).
cudaError_t launch_balanced_counts(const int32_t* expert_ids, int64_t num_tokens, int top_k, int num_experts,
                                   int64_t tokens_per_source, int num_sources, int32_t* entry_rank,
                                   int32_t* chunk_base, int32_t* counts, cudaStream_t stream);
// slots [T * k]: the entry's index among its (source, expert) entries picks the pair's route, routes of
// pair source * E + expert being [route_offsets[pair], route_offsets[pair + 1]) with cumulative token
// ends route_ends (eplb::BalancedRouteTable); every pair with entries must have routes holding them all.
cudaError_t launch_balanced_pick(const int32_t* expert_ids, const int32_t* entry_rank, const int32_t* chunk_base,
                                 int64_t num_tokens, int top_k, int num_experts, int64_t tokens_per_source,
                                 const int32_t* route_offsets, const int32_t* route_slots, const int32_t* route_ends,
                                 int32_t* slots, cudaStream_t stream);

// Exclusive prefix sum of values [n] into out [n] (single block loop; n is T or P, small).
cudaError_t launch_exclusive_scan(const int32_t* values, int64_t n, int32_t* out, int32_t* total, cudaStream_t stream);

// Permutation: slot_counts [P] (zeroed by the launcher), then offsets [P + 1] (exclusive scan).
cudaError_t launch_slot_counts(const int32_t* slots, int64_t num_entries, int num_slots, int32_t* slot_counts,
                               int32_t* offsets, cudaStream_t stream);
// Scatter: each entry takes a row of its slot (cursor [P] starts as a copy of offsets and is consumed),
// entry_row [T * k] (the inverse index for combine) and permuted [T * k, H] = x [token] rows.
cudaError_t launch_permute_rows(const uint16_t* x, int64_t num_tokens, int top_k, int hidden_size,
                                const int32_t* slots, int32_t* cursor, int32_t* entry_row, uint16_t* permuted,
                                cudaStream_t stream);
// The scatter of an FP8 layer fused with the 1x128 e4m3 quantization its grouped GEMM needs (fp8_permute.cu):
// each entry takes a row of its slot as above (cursor a copy of offsets [P + 1], consumed; entry_row [T * k]),
// and instead of a bf16 copy, row r of slot s gets q [r][0, H) e4m3 and scales sa(r, kb) at
// scales[f * Kb + kb * m + (r - f)] (f = offsets[s], m = offsets[s + 1] - f, Kb = H / 128): bit for bit what
// gpu::launch_quantize_rows_fp8 (gpu/kernels/fp8_quant.hpp) writes for launch_permute_rows' rows with the P slots
// as its groups. Each token's row of x [T, H] is read once, each (token, block) quantized once and stored k times.
// q [T * k, H], scales [T * k * Kb]. cudaErrorInvalidValue for H % 128 != 0, top_k outside [1, kMaxTopK], null
// pointers, x or q not 16-byte aligned. Capture-safe (the grid depends on num_tokens only).
cudaError_t launch_permute_rows_fp8(const uint16_t* x, int64_t num_tokens, int top_k, int hidden_size,
                                    const int32_t* slots, const int32_t* offsets, int32_t* cursor, int32_t* entry_row,
                                    uint8_t* q, float* scales, cudaStream_t stream);

// The permutation of a small step in one launch (T * k <= kSmallPlanMaxEntries, P <= kSmallPlanMaxSlots):
// slot_counts [P] and offsets [P + 1] as launch_slot_counts; entry_row [T * k] with a slot's entries in entry
// order (deterministic); row_token [T * k], the token of each permuted row; active [1 + min(T * k, P)], how many
// slots have rows, then those slots ascending. No permuted copy of x: the expert skinny GEMMs
// (gpu/kernels/expert_skinny_gemm.hpp) read token rows through row_token.
constexpr int64_t kSmallPlanMaxEntries = 1024;
constexpr int kSmallPlanMaxSlots = 4096;
cudaError_t launch_small_permutation(const int32_t* slots, int64_t num_entries, int top_k, int num_slots,
                                     int32_t* slot_counts, int32_t* offsets, int32_t* entry_row, int32_t* row_token,
                                     int32_t* active, cudaStream_t stream);

// The permuted rows of a small plan: permuted [r] = x [row_token[r]] for r < num_rows (row_token from
// launch_small_permutation / launch_small_route_permute). One warp per row, 16-byte copies when H % 8 == 0 and x,
// permuted are 16-byte aligned. Launched as a programmatic dependent (gpu/kernels/dependent_launch.cuh).
cudaError_t launch_gather_rows(const uint16_t* x, const int32_t* row_token, int64_t num_rows, int hidden_size,
                               uint16_t* permuted, cudaStream_t stream);

// launch_moe_router (static replicas only: args.static_slot_of set) and launch_small_permutation of its slots in
// one single-block launch, for the same bounds; the same outputs bit for bit as the two launches.
cudaError_t launch_small_route_permute(const RouterArgs& args, int num_slots, int32_t* slot_counts, int32_t* offsets,
                                      int32_t* entry_row, int32_t* row_token, int32_t* active, cudaStream_t stream);

// act [n, I] = bf16(silu(gate) * up) from h [n, 2I] (gate | up), fp32 math.
cudaError_t launch_silu_mul_bf16(const uint16_t* h, int64_t num_rows, int intermediate_size, uint16_t* act,
                                 cudaStream_t stream);
// The same over rows [*row_begin, *row_end) read on the device (the CUTLASS path knows no counts on the host),
// rows indexing h and act alike; max_rows (host) bounds the grid and the rows done.
cudaError_t launch_silu_mul_bf16_rows(const uint16_t* h, const int32_t* row_begin, const int32_t* row_end,
                                      int64_t max_rows, int intermediate_size, uint16_t* act, cudaStream_t stream);

// out [T, H] = sum_j weights[t*k+j] * rows[entry_row[t*k+j]] (bf16 rows, fp32 sum in j order).
cudaError_t launch_combine_f32(const uint16_t* rows, const int32_t* entry_row, const float* weights,
                               int64_t num_tokens, int top_k, int hidden_size, float* out, cudaStream_t stream);

// A deterministic pseudo-random bf16 fill in [-scale, scale) (bench weights without a host round trip):
// out[i] is a hash of (seed, first_index + i), so a slice of an array can be filled with the values the whole
// array would hold there.
cudaError_t launch_fill_random_bf16(uint16_t* out, int64_t n, uint64_t seed, float scale, cudaStream_t stream,
                                    int64_t first_index = 0);
// The FP8 twin: out[i] = e4m3((2u - 1) * 448) of the same stream (CPU reference model::random_e4m3_reference).
cudaError_t launch_fill_random_e4m3(uint8_t* out, int64_t n, uint64_t seed, cudaStream_t stream);
// out[i] = value for i < n.
cudaError_t launch_fill_f32(float* out, int64_t n, float value, cudaStream_t stream);

}  // namespace fulcrum::cuda::moe
