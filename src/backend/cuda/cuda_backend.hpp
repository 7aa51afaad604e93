#pragma once
// CUDA fp32 backend: the same math as the CPU reference (src/backend/cpu), correctness first. Tensors
// live in device memory (cudaMalloc, freed when the last view goes); all work runs in order on one
// stream the backend owns; upload, download and route synchronize with it. Matmul goes through cuBLAS
// with fp32 compute (no TF32); the other operations are simple kernels (kernels.hpp).
//
// This header includes no CUDA header, so host code (tests, the CLI) can use it with any compiler.
#include "model/backend.hpp"

struct CUstream_st;    // cudaStream_t is CUstream_st*
struct cublasContext;  // cublasHandle_t is cublasContext*

namespace fulcrum::backend {

class CudaBackend final : public model::Backend {
 public:
  // Throws fulcrum::Error ("no CUDA device ...") when the device does not exist.
  explicit CudaBackend(int device_idx = 0);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  // CUDA devices visible to this process; 0 when there is none or no usable driver (never throws).
  static int device_count();

  std::string name() const override { return "cuda"; }
  model::Device device() const override { return model::Device::kCuda; }

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

  // Waits for every operation enqueued so far.
  void synchronize();

 private:
  int device_idx_ = 0;
  size_t max_shared_bytes_per_block_ = 0;  // opt-in limit, bounds the attention key count
  CUstream_st* stream_ = nullptr;
  cublasContext* cublas_ = nullptr;
};

}  // namespace fulcrum::backend
