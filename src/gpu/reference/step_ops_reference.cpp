#include "gpu/reference/step_ops_reference.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "eplb/error.hpp"
#include "model/checkpoint_writer.hpp"

namespace fulcrum::gpu::reference {
namespace {

using model::bf16_bits_to_f32;
using model::f32_to_bf16_bits;

// rms_norm's arithmetic (CpuBackend::rms_norm): sum of squares in double, mean and scale in fp32.
float inv_rms(const float* x, int dim, float eps) {
  double sum_sq = 0;
  for (int i = 0; i < dim; ++i) sum_sq += static_cast<double>(x[i]) * x[i];
  const float variance = static_cast<float>(sum_sq / static_cast<double>(dim));
  return 1.0f / std::sqrt(variance + eps);
}

}  // namespace

void embedding(std::span<const uint16_t> table, std::span<const int32_t> token_ids, int hidden, std::span<float> residual) {
  FULCRUM_CHECK(residual.size() == token_ids.size() * static_cast<size_t>(hidden), "embedding: output size");
  for (size_t t = 0; t < token_ids.size(); ++t) {
    const size_t row = static_cast<size_t>(token_ids[t]) * hidden;
    FULCRUM_CHECK(row + hidden <= table.size(), "embedding: token {} outside the table", token_ids[t]);
    for (int i = 0; i < hidden; ++i) residual[t * hidden + i] = bf16_bits_to_f32(table[row + i]);
  }
}

void add_rms_norm(std::span<float> residual, std::span<const float> delta, std::span<const uint16_t> weight, float eps,
                  std::span<const int32_t> rows, int hidden, std::span<uint16_t> out) {
  const size_t num_out = out.size() / hidden;
  for (size_t i = 0; i < num_out; ++i) {
    const size_t r = rows.empty() ? i : static_cast<size_t>(rows[i]);
    float* x = residual.data() + r * hidden;
    if (!delta.empty()) {
      for (int j = 0; j < hidden; ++j) x[j] += delta[r * hidden + j];
    }
    const float scale = inv_rms(x, hidden, eps);
    for (int j = 0; j < hidden; ++j) out[i * hidden + j] = f32_to_bf16_bits(bf16_bits_to_f32(weight[j]) * (x[j] * scale));
  }
}

void qk_norm_rope_kv_append(std::span<const float> qkv, std::span<const uint16_t> q_norm, std::span<const uint16_t> k_norm,
                            float eps, std::span<const int32_t> positions, std::span<const float> inv_freq,
                            std::span<const int32_t> kv_rows, int num_heads, int num_kv_heads, int head_dim,
                            std::span<uint16_t> q_out, std::span<uint16_t> k_pool, std::span<uint16_t> v_pool) {
  const int half = head_dim / 2;
  const size_t width = static_cast<size_t>(num_heads + 2 * num_kv_heads) * head_dim;
  const size_t kv_row_values = static_cast<size_t>(num_kv_heads) * head_dim;
  const size_t pool_values = std::min(k_pool.size(), v_pool.size());
  FULCRUM_CHECK(qkv.size() == positions.size() * width && kv_rows.size() == positions.size() &&
                    q_out.size() == positions.size() * num_heads * head_dim,
                "qk_norm_rope_kv_append: {} tokens do not match the qkv, kv_rows or q_out sizes", positions.size());
  std::vector<float> head(static_cast<size_t>(head_dim)), cos_v(half), sin_v(half);
  for (size_t t = 0; t < positions.size(); ++t) {
    for (int i = 0; i < half; ++i) {
      const float angle = static_cast<float>(positions[t]) * inv_freq[i];
      cos_v[i] = std::cos(angle);
      sin_v[i] = std::sin(angle);
    }
    const float* row = qkv.data() + t * width;
    const bool append_kv = kv_rows[t] >= 0;
    FULCRUM_CHECK(!append_kv || (static_cast<size_t>(kv_rows[t]) + 1) * kv_row_values <= pool_values,
                  "qk_norm_rope_kv_append: kv row {} outside the pools", kv_rows[t]);
    // Heads 0..Hq-1 are q, Hq..Hq+Hkv-1 are k: normalized and rotated; then v copied. Padding tokens stop after q.
    const int normed_heads = append_kv ? num_heads + num_kv_heads : num_heads;
    for (int h = 0; h < normed_heads; ++h) {
      const bool is_q = h < num_heads;
      const float* src = row + static_cast<size_t>(h) * head_dim;
      const std::span<const uint16_t> w = is_q ? q_norm : k_norm;
      const float scale = inv_rms(src, head_dim, eps);
      for (int i = 0; i < head_dim; ++i) head[i] = bf16_bits_to_f32(w[i]) * (src[i] * scale);
      uint16_t* dst = is_q ? q_out.data() + (t * num_heads + h) * head_dim
                           : k_pool.data() + (static_cast<size_t>(kv_rows[t]) * num_kv_heads + (h - num_heads)) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float a = head[i], b = head[i + half];
        dst[i] = f32_to_bf16_bits(a * cos_v[i] - b * sin_v[i]);
        dst[i + half] = f32_to_bf16_bits(b * cos_v[i] + a * sin_v[i]);
      }
    }
    if (!append_kv) continue;
    for (int h = 0; h < num_kv_heads; ++h) {
      const float* src = row + static_cast<size_t>(num_heads + num_kv_heads + h) * head_dim;
      uint16_t* dst = v_pool.data() + (static_cast<size_t>(kv_rows[t]) * num_kv_heads + h) * head_dim;
      for (int i = 0; i < head_dim; ++i) dst[i] = f32_to_bf16_bits(src[i]);
    }
  }
}

void silu_mul(std::span<const float> gate_up, int64_t num_rows, int width, std::span<uint16_t> act) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* g = gate_up.data() + r * 2 * width;
    for (int i = 0; i < width; ++i) {
      const float gate = g[i];
      act[r * width + i] = f32_to_bf16_bits(gate / (1.0f + std::exp(-gate)) * g[width + i]);
    }
  }
}

}  // namespace fulcrum::gpu::reference
