#pragma once
// The operations the model needs, implemented once per device (src/backend/<device>/). The model
// (qwen3_moe.cpp) calls only these, so a CUDA backend can be added beside the CPU reference.
//
// Conventions: tensors are fp32, row-major, allocated by the same backend. Index lists (token ids,
// positions, row indices) are host spans; a device backend uploads them. Ops return new tensors unless
// named *_inplace / write_*.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/tensor.hpp"

namespace fulcrum::model {

// Top-k routing decision of every token, on the host: entry [t * top_k + j] is token t's j-th choice,
// in descending probability (ties: lower expert index first).
struct RouterChoice {
  int top_k = 0;
  std::vector<int32_t> expert_ids;  // [num_tokens * top_k] logical expert ids
  std::vector<float> weights;       // [num_tokens * top_k] softmax probability (renormalized if asked)
};

// Where one sequence's key/value positions live in a paged pool tensor [num_pool_rows, num_kv_heads,
// head_dim]: position p is row page_ids[p / page_size] * page_size + p % page_size. Page ids need not be
// ascending or adjacent. A contiguous cache is the one-page table {0} with page_size = its capacity.
struct KvPages {
  std::span<const int32_t> page_ids;  // [num_pages] in position order
  int64_t page_size = 0;

  int64_t capacity() const { return page_size * static_cast<int64_t>(page_ids.size()); }
  int64_t row(int64_t pos) const { return int64_t{page_ids[pos / page_size]} * page_size + pos % page_size; }
};

// The rules every backend applies to a paged KV access: positions [0, end_pos) fit the page table and every
// page lies inside `pool`. Throws fulcrum::Error naming `what`.
void check_kv_pages(const Tensor& pool, KvPages pages, int64_t end_pos, const char* what);
// The rules of Backend::paged_attention's arguments (head counts and sizes, pool shapes, pages), shared by
// every backend.
void check_paged_attention(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool, KvPages pages,
                           int64_t start_pos);

// RoPE inverse frequencies [head_dim / 2] in fp32 exactly as HF computes them: 1 / theta^(2i / head_dim).
// Every backend derives its angles from these, so rotations agree bit for bit.
std::vector<float> rope_inv_freq(int64_t head_dim, double rope_theta);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;

  // Memory.
  virtual Tensor zeros(std::vector<int64_t> shape) = 0;
  virtual void upload(const Tensor& dst, std::span<const float> src) = 0;  // src.size() == dst.numel()
  virtual std::vector<float> download(const Tensor& src) = 0;
  virtual void copy(const Tensor& dst, const Tensor& src) = 0;  // same numel

  // out[t] = table[token_ids[t]]: table [vocab_size, hidden_size] -> [num_tokens, hidden_size].
  virtual Tensor embedding(const Tensor& table, std::span<const int32_t> token_ids) = 0;
  // Each row of x [num_rows, dim]: x * rsqrt(mean(x^2) + eps) * weight [dim], in fp32 like HF.
  virtual Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps) = 0;
  // x [num_rows, in_features] @ weight[out_features, in_features]^T -> [num_rows, out_features].
  virtual Tensor matmul(const Tensor& x, const Tensor& weight) = 0;
  // Rotary embedding in place on x [num_tokens, num_heads, head_dim], HF rotate_half convention:
  // the pair (i, i + head_dim/2) rotates by positions[t] * theta^(-2i/head_dim).
  virtual void rope_inplace(const Tensor& x, std::span<const int32_t> positions, double rope_theta) = 0;
  // Paged KV write: pool rows of positions [start_pos, start_pos + num_tokens) = src [num_tokens, num_kv_heads,
  // head_dim]. One scatter_rows, so it is exact on every backend.
  void write_kv(const Tensor& pool, const Tensor& src, KvPages pages, int64_t start_pos);
  // Causal grouped-query attention of one sequence over a paged pool: q [num_tokens, num_heads, head_dim] at
  // positions start_pos.., keys/values at positions [0, start_pos + num_tokens) read through `pages`; query i
  // sees positions [0, start_pos + i], in position order (so the page layout never changes the result).
  // Scale 1/sqrt(head_dim); query head h reads kv head h / (num_heads / num_kv_heads).
  // Returns [num_tokens, num_heads * head_dim].
  virtual Tensor paged_attention(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool, KvPages pages,
                                 int64_t start_pos) = 0;
  // The same on a contiguous cache [capacity, num_kv_heads, head_dim] (position p in row p).
  void write_kv(const Tensor& cache, const Tensor& src, int64_t start_pos);
  Tensor attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int64_t start_pos);
  // gate_up [num_rows, 2 * n] (gate | up) -> silu(gate) * up [num_rows, n].
  virtual Tensor silu_mul(const Tensor& gate_up) = 0;
  // x += y, same shape.
  virtual void add_inplace(const Tensor& x, const Tensor& y) = 0;
  // Softmax (fp32) over router_logits [num_tokens, num_experts], top-k, optional renormalization.
  virtual RouterChoice route(const Tensor& router_logits, int top_k, bool norm_topk_prob) = 0;
  // out[i] = x[row_idx[i]]: -> [row_idx.size(), row...].
  virtual Tensor gather_rows(const Tensor& x, std::span<const int32_t> row_idx) = 0;
  // dst[row_idx[i]] = src[i].
  virtual void scatter_rows(const Tensor& dst, const Tensor& src, std::span<const int32_t> row_idx) = 0;
  // rows [num_tokens * k, dim], weights [num_tokens * k] -> out[t] = sum_j weights[t*k+j] * rows[t*k+j],
  // summed in j order starting from zero: [num_tokens, dim].
  virtual Tensor weighted_sum(const Tensor& rows, std::span<const float> weights, int k) = 0;
};

}  // namespace fulcrum::model
