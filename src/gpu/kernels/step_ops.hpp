#pragma once
// The GPU engine's per-token kernels (step_ops.cu) as raw-pointer launchers, in the style of
// src/gpu/moe/moe_kernels.hpp: each enqueues its work on `stream` and returns the launch status. CPU
// reference of each, with the exact arithmetic: src/gpu/reference/step_ops_reference.hpp. All pointers are
// device pointers, bf16 tensors are uint16_t bits, fp32 tensors dense row-major. Every launcher accepts zero
// rows (no launch, cudaSuccess), allocates nothing and synchronizes nothing, so it can be captured in a CUDA
// graph: the row counts and shapes are host values fixed for a captured batch size; token ids, positions,
// gathered rows and KV rows are read from device memory at run time.
//
// Alignment: rows take 16-byte vector loads / stores when every pointer is 16-byte aligned and the row
// width allows it (hidden % 8 == 0, width % 4 == 0); otherwise a scalar path gives the same results.
#include <cstdint>

#include <cuda_runtime.h>

namespace fulcrum::gpu {

// residual [T, H] fp32 <- table[token_ids[t]] (table [V, H] bf16). Token ids must lie in [0, V) (not checked).
cudaError_t launch_embedding(const uint16_t* table, const int32_t* token_ids, int64_t num_tokens, int hidden,
                             float* residual, cudaStream_t stream);

// For each output row i, source row r = rows ? rows[i] : i: residual[r] += delta[r] (written back, so the
// residual stream advances; delta may be null: no add), then out[i] = bf16(weight * residual[r] * inv_rms), sum
// of squares in double. residual and delta [*, H] fp32, weight [H] bf16, rows [num_out_rows] (distinct when
// delta is given), out [num_out_rows, H] bf16. One block per row; hidden % 8 == 0 and <= 8192 is the fast path.
cudaError_t launch_add_rms_norm(float* residual, const float* delta, const uint16_t* weight, float eps,
                                const int32_t* rows, int64_t num_out_rows, int hidden, uint16_t* out,
                                cudaStream_t stream);

// The MoE layer's combine as the delta of add + RMSNorm (one launch instead of combine, then add + RMSNorm):
// delta[r] = sum_j weights[r * k + j] * expert_rows[entry_row[r * k + j]] (bf16 rows [T * k, H], fp32 FMAs in j
// order, the router's order), the rest as launch_add_rms_norm. The vector path only: hidden % 8 == 0, <= 8192,
// residual, expert_rows, weight and out 16-byte aligned (moe_combine_add_rms_norm_supported says whether a hidden
// size can), else cudaErrorInvalidValue. CPU reference: reference::add_rms_norm on model::moe::combine_reference.
struct MoeCombineDelta {
  const uint16_t* expert_rows = nullptr;
  const int32_t* entry_row = nullptr;
  const float* weights = nullptr;
  int top_k = 0;
};
bool moe_combine_add_rms_norm_supported(int hidden);
cudaError_t launch_moe_combine_add_rms_norm(float* residual, const MoeCombineDelta& moe, const uint16_t* weight,
                                            float eps, const int32_t* rows, int64_t num_out_rows, int hidden,
                                            uint16_t* out, cudaStream_t stream);

// Head dims launch_qk_norm_rope_kv_append supports: 16, 32, 64, 128, 256.
constexpr bool step_ops_supports_head_dim(int head_dim) {
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// The attention prologue of T tokens: qkv [T, (Hq + 2 Hkv) * D] fp32 (q heads, k heads, v heads); q and k heads
// RMSNorm'ed over D (q_norm / k_norm [D] bf16), rotated by RoPE at positions[t] (angle float(position) *
// inv_freq[i], inv_freq [D / 2] fp32), rounded to bf16: q -> q_out [T, Hq, D]; k and v (bf16 of the raw values)
// -> row kv_rows[t] of k_pool / v_pool [rows, Hkv, D]. A token with kv_rows[t] < 0 (padding of a graph bucket)
// writes q_out only. Returns cudaErrorInvalidValue for a head_dim outside step_ops_supports_head_dim.
cudaError_t launch_qk_norm_rope_kv_append(const float* qkv, const uint16_t* q_norm, const uint16_t* k_norm, float eps,
                                          const int32_t* positions, const float* inv_freq, const int32_t* kv_rows,
                                          int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim,
                                          uint16_t* q_out, uint16_t* k_pool, uint16_t* v_pool, cudaStream_t stream);

// Dense SwiGLU: gate_up [T, 2I] fp32 (gate | up) -> act [T, I] = bf16(silu(gate) * up), I = width.
cudaError_t launch_silu_mul(const float* gate_up, int64_t num_rows, int width, uint16_t* act, cudaStream_t stream);

}  // namespace fulcrum::gpu
