#pragma once
// CPU fp32 reference backend: plain loops, double accumulators for dot products and reductions, written
// for clarity and exactness rather than speed. Every other backend is checked against it.
#include "model/backend.hpp"

namespace fulcrum::backend {

class CpuBackend final : public model::Backend {
 public:
  std::string name() const override { return "cpu"; }
  model::Device device() const override { return model::Device::kCpu; }

  model::Tensor zeros(std::vector<int64_t> shape) override;
  void upload(const model::Tensor& dst, std::span<const float> src) override;
  std::vector<float> download(const model::Tensor& src) override;
  void copy(const model::Tensor& dst, const model::Tensor& src) override;

  model::Tensor embedding(const model::Tensor& table, std::span<const int32_t> token_ids) override;
  model::Tensor rms_norm(const model::Tensor& x, const model::Tensor& weight, float eps) override;
  model::Tensor matmul(const model::Tensor& x, const model::Tensor& weight) override;
  void rope_inplace(const model::Tensor& x, std::span<const int32_t> positions, double rope_theta) override;
  model::Tensor paged_attention(const model::Tensor& q, const model::Tensor& k_pool, const model::Tensor& v_pool,
                                model::KvPages pages, int64_t start_pos) override;
  model::Tensor silu_mul(const model::Tensor& gate_up) override;
  void add_inplace(const model::Tensor& x, const model::Tensor& y) override;
  model::RouterChoice route(const model::Tensor& router_logits, int top_k, bool norm_topk_prob) override;
  model::Tensor gather_rows(const model::Tensor& x, std::span<const int32_t> row_idx) override;
  void scatter_rows(const model::Tensor& dst, const model::Tensor& src, std::span<const int32_t> row_idx) override;
  model::Tensor weighted_sum(const model::Tensor& rows, std::span<const float> weights, int k) override;
};

}  // namespace fulcrum::backend
