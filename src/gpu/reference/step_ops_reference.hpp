#pragma once
// CPU references of the GPU engine's per-token kernels (src/gpu/kernels/step_ops.cu), in plain C++. The GPU
// engine keeps the residual stream in fp32 and feeds GEMMs bf16; these functions round to bf16 at the same
// points, so kernel and reference differ only by fp32 summation order. bf16 values are uint16_t bits.
#include <cstdint>
#include <span>

namespace fulcrum::gpu::reference {

// residual [T, H] fp32 <- table[token_ids[t]] (bf16 rows of [V, H]) converted to fp32.
void embedding(std::span<const uint16_t> table, std::span<const int32_t> token_ids, int hidden, std::span<float> residual);

// For each output row i (source row r = rows.empty() ? i : rows[i]): residual[r] += delta[r] (fp32; delta may
// be empty), then out[i] = bf16(weight * (residual[r] * inv_rms)), inv_rms = 1 / sqrt(mean(residual[r]^2) + eps)
// with the sum of squares in double and the mean in fp32, as CpuBackend::rms_norm. out [num_out_rows, H].
void add_rms_norm(std::span<float> residual, std::span<const float> delta, std::span<const uint16_t> weight, float eps,
                  std::span<const int32_t> rows, int hidden, std::span<uint16_t> out);

// The attention prologue of every token t, from qkv [T, (Hq + 2 Hkv) * D] fp32 (q heads, then k heads, then v):
// q and k heads RMSNorm'ed over D with q_norm / k_norm (bf16 [D]; rms_norm's arithmetic), then rotated by RoPE at
// positions[t] (HF rotate_half; angle = float(position) * inv_freq[i] in fp32, cos / sin of it, as
// CpuBackend::rope_inplace), then rounded to bf16: q -> q_out [T, Hq, D]; k -> k_pool row kv_rows[t], v (bf16 of the
// raw values) -> v_pool row kv_rows[t]; pools are [rows, Hkv, D]. inv_freq: model::rope_inv_freq [D / 2].
// A token with kv_rows[t] < 0 (a padding row of a CUDA-graph batch bucket) writes q_out but no K / V.
void qk_norm_rope_kv_append(std::span<const float> qkv, std::span<const uint16_t> q_norm, std::span<const uint16_t> k_norm,
                            float eps, std::span<const int32_t> positions, std::span<const float> inv_freq,
                            std::span<const int32_t> kv_rows, int num_heads, int num_kv_heads, int head_dim,
                            std::span<uint16_t> q_out, std::span<uint16_t> k_pool, std::span<uint16_t> v_pool);

// Dense SwiGLU activation: gate_up [T, 2I] fp32 (gate | up) -> act [T, I] = bf16(silu(gate) * up).
void silu_mul(std::span<const float> gate_up, int64_t num_rows, int width, std::span<uint16_t> act);

}  // namespace fulcrum::gpu::reference
