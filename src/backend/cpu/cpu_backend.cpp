#include "backend/cpu/cpu_backend.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "model/parallel_chunks.hpp"

namespace fulcrum::backend {

using model::Tensor;

namespace {

void check_cpu(const Tensor& t, const char* what) {
  FULCRUM_CHECK(t.device() == model::Device::kCpu, "cpu backend: {} is not a host tensor", what);
}

}  // namespace

Tensor CpuBackend::zeros(std::vector<int64_t> shape) {
  int64_t numel = 1;
  for (const int64_t d : shape) {
    FULCRUM_CHECK(d >= 0, "cpu backend: negative dimension {}", d);
    numel *= d;
  }
  std::shared_ptr<float[]> storage(new float[static_cast<size_t>(std::max<int64_t>(numel, 1))]());
  float* data = storage.get();
  return Tensor(std::shared_ptr<void>(storage, data), data, std::move(shape), model::Device::kCpu);
}

void CpuBackend::upload(const Tensor& dst, std::span<const float> src) {
  check_cpu(dst, "upload destination");
  FULCRUM_CHECK(static_cast<int64_t>(src.size()) == dst.numel(), "upload of {} values into a tensor of {}",
                src.size(), dst.numel());
  if (!src.empty()) std::memcpy(dst.data(), src.data(), src.size() * sizeof(float));
}

std::vector<float> CpuBackend::download(const Tensor& src) {
  check_cpu(src, "download source");
  return std::vector<float>(src.data(), src.data() + src.numel());
}

void CpuBackend::copy(const Tensor& dst, const Tensor& src) {
  FULCRUM_CHECK(dst.numel() == src.numel(), "copy of {} values into a tensor of {}", src.numel(), dst.numel());
  if (src.numel() > 0) std::memmove(dst.data(), src.data(), static_cast<size_t>(src.numel()) * sizeof(float));
}

Tensor CpuBackend::embedding(const Tensor& table, std::span<const int32_t> token_ids) {
  const int64_t vocab_size = table.dim(0);
  const int64_t hidden_size = table.dim(1);
  Tensor out = zeros({static_cast<int64_t>(token_ids.size()), hidden_size});  // [num_tokens, hidden_size]
  for (size_t t = 0; t < token_ids.size(); ++t) {
    FULCRUM_CHECK(token_ids[t] >= 0 && token_ids[t] < vocab_size, "token id {} out of range [0, {})", token_ids[t],
                  vocab_size);
    std::memcpy(out.data() + t * hidden_size, table.data() + token_ids[t] * hidden_size, hidden_size * sizeof(float));
  }
  return out;
}

Tensor CpuBackend::rms_norm(const Tensor& x, const Tensor& weight, float eps) {
  const int64_t dim = weight.numel();
  FULCRUM_CHECK(x.numel() % dim == 0, "rms_norm: {} values are not rows of {}", x.numel(), dim);
  Tensor out = zeros(x.shape());
  const int64_t num_rows = x.numel() / dim;
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* in = x.data() + r * dim;
    float* o = out.data() + r * dim;
    double sum_sq = 0;
    for (int64_t i = 0; i < dim; ++i) sum_sq += static_cast<double>(in[i]) * in[i];
    const float variance = static_cast<float>(sum_sq / static_cast<double>(dim));
    const float inv_rms = 1.0f / std::sqrt(variance + eps);
    for (int64_t i = 0; i < dim; ++i) o[i] = weight.data()[i] * (in[i] * inv_rms);
  }
  return out;
}

Tensor CpuBackend::matmul(const Tensor& x, const Tensor& weight) {
  FULCRUM_CHECK(x.rank() == 2 && weight.rank() == 2 && x.dim(1) == weight.dim(1),
                "matmul: x [{}, {}] does not match weight [{}, {}]", x.rank() ? x.dim(0) : 0, x.rank() > 1 ? x.dim(1) : 0,
                weight.rank() ? weight.dim(0) : 0, weight.rank() > 1 ? weight.dim(1) : 0);
  const int64_t num_rows = x.dim(0), in_features = x.dim(1), out_features = weight.dim(0);
  Tensor out = zeros({num_rows, out_features});  // [num_rows, out_features]
  // Output columns over threads: each element is still one sum in input order (the same bits on any thread count).
  model::parallel_chunks(out_features, num_rows * in_features, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t r = 0; r < num_rows; ++r) {
      const float* xr = x.data() + r * in_features;
      for (int64_t n = n_begin; n < n_end; ++n) {
        const float* wn = weight.data() + n * in_features;
        double acc = 0;
        for (int64_t i = 0; i < in_features; ++i) acc += static_cast<double>(xr[i]) * wn[i];
        out.data()[r * out_features + n] = static_cast<float>(acc);
      }
    }
  });
  return out;
}

void CpuBackend::rope_inplace(const Tensor& x, std::span<const int32_t> positions, double rope_theta) {
  const int64_t num_tokens = x.dim(0), num_heads = x.dim(1), head_dim = x.dim(2);
  FULCRUM_CHECK(static_cast<int64_t>(positions.size()) == num_tokens, "rope: {} positions for {} tokens",
                positions.size(), num_tokens);
  const int64_t half = head_dim / 2;
  const std::vector<float> inv_freq = model::rope_inv_freq(head_dim, rope_theta);
  std::vector<float> cos_v(static_cast<size_t>(half)), sin_v(static_cast<size_t>(half));
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(positions[t]) * inv_freq[i];
      cos_v[i] = std::cos(angle);
      sin_v[i] = std::sin(angle);
    }
    for (int64_t h = 0; h < num_heads; ++h) {
      float* v = x.data() + (t * num_heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos_v[i] - b * sin_v[i];
        v[i + half] = b * cos_v[i] + a * sin_v[i];
      }
    }
  }
}

Tensor CpuBackend::paged_attention(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool, model::KvPages pages,
                                  int64_t start_pos) {
  const int64_t num_tokens = q.dim(0), num_heads = q.dim(1), head_dim = q.dim(2);
  const int64_t num_kv_heads = k_pool.dim(1);
  model::check_paged_attention(q, k_pool, v_pool, pages, start_pos);
  std::vector<int64_t> key_rows(static_cast<size_t>(start_pos + num_tokens));  // pool row of each position
  for (size_t j = 0; j < key_rows.size(); ++j) key_rows[j] = pages.row(static_cast<int64_t>(j));
  const int64_t group = num_heads / num_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  Tensor out = zeros({num_tokens, num_heads * head_dim});  // [num_tokens, num_heads * head_dim]
  // (token, head) pairs over threads: each output row is computed by one thread in the one-thread order.
  const int64_t cost = 2 * (start_pos + num_tokens) * head_dim;
  model::parallel_chunks(num_tokens * num_heads, cost, [&](int64_t begin, int64_t end) {
    std::vector<double> scores(static_cast<size_t>(start_pos + num_tokens));
    std::vector<double> acc(static_cast<size_t>(head_dim));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / num_heads, h = item % num_heads;
      const int64_t num_keys = start_pos + t + 1;  // causal: keys at positions <= this query's
      const int64_t kv_h = h / group;
      const float* qv = q.data() + (t * num_heads + h) * head_dim;
      double max_score = -INFINITY;
      for (int64_t j = 0; j < num_keys; ++j) {
        const float* kv = k_pool.data() + (key_rows[j] * num_kv_heads + kv_h) * head_dim;
        double dot = 0;
        for (int64_t d = 0; d < head_dim; ++d) dot += static_cast<double>(qv[d]) * kv[d];
        scores[j] = dot * scale;
        max_score = std::max(max_score, scores[j]);
      }
      double denom = 0;
      for (int64_t j = 0; j < num_keys; ++j) denom += (scores[j] = std::exp(scores[j] - max_score));
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j < num_keys; ++j) {
        const float* vv = v_pool.data() + (key_rows[j] * num_kv_heads + kv_h) * head_dim;
        const double p = scores[j] / denom;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * vv[d];
      }
      float* o = out.data() + (t * num_heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<float>(acc[d]);
    }
  });
  return out;
}

Tensor CpuBackend::silu_mul(const Tensor& gate_up) {
  const int64_t num_rows = gate_up.dim(0), width = gate_up.dim(1) / 2;
  Tensor out = zeros({num_rows, width});  // [num_rows, width]
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* gate = gate_up.data() + r * 2 * width;
    const float* up = gate + width;
    for (int64_t i = 0; i < width; ++i) {
      const float silu = gate[i] / (1.0f + std::exp(-gate[i]));
      out.data()[r * width + i] = silu * up[i];
    }
  }
  return out;
}

void CpuBackend::add_inplace(const Tensor& x, const Tensor& y) {
  FULCRUM_CHECK(x.shape() == y.shape(), "add: shapes differ");
  for (int64_t i = 0; i < x.numel(); ++i) x.data()[i] += y.data()[i];
}

model::RouterChoice CpuBackend::route(const Tensor& router_logits, int top_k, bool norm_topk_prob) {
  const int64_t num_tokens = router_logits.dim(0), num_experts = router_logits.dim(1);
  FULCRUM_CHECK(top_k > 0 && top_k <= num_experts, "route: top-k {} out of range for {} experts", top_k, num_experts);
  model::RouterChoice choice;
  choice.top_k = top_k;
  choice.expert_ids.resize(static_cast<size_t>(num_tokens * top_k));
  choice.weights.resize(static_cast<size_t>(num_tokens * top_k));
  std::vector<float> probs(static_cast<size_t>(num_experts));
  std::vector<int32_t> order(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* logits = router_logits.data() + t * num_experts;
    const float max_logit = *std::max_element(logits, logits + num_experts);
    double denom = 0;
    for (int64_t e = 0; e < num_experts; ++e) denom += std::exp(static_cast<double>(logits[e]) - max_logit);
    for (int64_t e = 0; e < num_experts; ++e) {
      probs[e] = static_cast<float>(std::exp(static_cast<double>(logits[e]) - max_logit) / denom);
    }
    // Descending probability; equal probabilities: lower expert index first.
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int32_t a, int32_t b) {
      return probs[a] != probs[b] ? probs[a] > probs[b] : a < b;
    });
    float sum = 0;
    for (int j = 0; j < top_k; ++j) sum += probs[order[j]];
    for (int j = 0; j < top_k; ++j) {
      choice.expert_ids[t * top_k + j] = order[j];
      choice.weights[t * top_k + j] = norm_topk_prob ? probs[order[j]] / sum : probs[order[j]];
    }
  }
  return choice;
}

Tensor CpuBackend::gather_rows(const Tensor& x, std::span<const int32_t> row_idx) {
  std::vector<int64_t> shape = x.shape();
  shape[0] = static_cast<int64_t>(row_idx.size());
  Tensor out = zeros(shape);  // [row_idx.size(), row...]
  const int64_t width = x.row_numel();
  for (size_t i = 0; i < row_idx.size(); ++i) {
    FULCRUM_CHECK(row_idx[i] >= 0 && row_idx[i] < x.dim(0), "gather_rows: row {} out of range", row_idx[i]);
    std::memcpy(out.data() + i * width, x.data() + row_idx[i] * width, width * sizeof(float));
  }
  return out;
}

void CpuBackend::scatter_rows(const Tensor& dst, const Tensor& src, std::span<const int32_t> row_idx) {
  const int64_t width = dst.row_numel();
  FULCRUM_CHECK(src.row_numel() == width && src.dim(0) == static_cast<int64_t>(row_idx.size()),
                "scatter_rows: {} source rows of {} for {} indices into rows of {}", src.dim(0), src.row_numel(),
                row_idx.size(), width);
  for (size_t i = 0; i < row_idx.size(); ++i) {
    FULCRUM_CHECK(row_idx[i] >= 0 && row_idx[i] < dst.dim(0), "scatter_rows: row {} out of range", row_idx[i]);
    std::memcpy(dst.data() + row_idx[i] * width, src.data() + i * width, width * sizeof(float));
  }
}

Tensor CpuBackend::weighted_sum(const Tensor& rows, std::span<const float> weights, int k) {
  FULCRUM_CHECK(k > 0 && rows.dim(0) % k == 0 && static_cast<int64_t>(weights.size()) == rows.dim(0),
                "weighted_sum: {} rows and {} weights do not form groups of {}", rows.dim(0), weights.size(), k);
  const int64_t num_tokens = rows.dim(0) / k, dim = rows.row_numel();
  Tensor out = zeros({num_tokens, dim});  // [num_tokens, dim]
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* o = out.data() + t * dim;
    for (int j = 0; j < k; ++j) {
      const float w = weights[t * k + j];
      const float* r = rows.data() + (t * k + j) * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] += r[d] * w;
    }
  }
  return out;
}

}  // namespace fulcrum::backend
