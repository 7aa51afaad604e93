#include "gpu/attention_runner.hpp"

#include <algorithm>

#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.hpp"
#include "eplb/error.hpp"
#include "gpu/flashinfer/flashinfer_attention.hpp"
#include "gpu/kernels/paged_attention.hpp"

namespace fulcrum::gpu {

int64_t AttentionRunner::decode_bucket(int64_t max_kv_len) {
  int64_t bucket = 256;
  while (bucket < max_kv_len) bucket *= 2;
  return bucket;
}

namespace {

// The engine's own kernels. The workspace grows (between steps, never inside a capture) to what a plan needs.
class OwnAttention final : public AttentionRunner {
 public:
  OwnAttention(const model::Qwen3MoeConfig& config, int max_seqs, int device_idx) : config_(config) {
    cudaDeviceProp prop{};
    FULCRUM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_idx));
    num_sms_ = prop.multiProcessorCount;
    max_cluster_ = paged_attention_max_cluster();
    FULCRUM_CHECK(paged_attention_supports_head_dim(config.head_dim) &&
                      config.num_attention_heads % config.num_key_value_heads == 0 &&
                      config.num_attention_heads / config.num_key_value_heads <= kPagedAttentionMaxGroup,
                  "GPU attention: head_dim {} with {} q heads over {} kv heads is not supported (head_dim 16, 32, 64, "
                  "128 or 256; at most {} q heads per kv head)",
                  config.head_dim, config.num_attention_heads, config.num_key_value_heads, kPagedAttentionMaxGroup);
    PagedAttentionShape probe;  // what the kernels would be for a one-token step (for name())
    probe.num_seqs = probe.num_tokens = 1;
    probe.num_heads = config.num_attention_heads;
    probe.num_kv_heads = config.num_key_value_heads;
    probe.head_dim = config.head_dim;
    probe.max_kv_len = 1;
    plan_ = plan_paged_attention(probe);
    // The decode splits' counters: zero once here, left zero by every launch.
    counter_capacity_ = static_cast<int64_t>(std::max(1, max_seqs)) * config.num_key_value_heads;
    FULCRUM_CUDA_CHECK(cudaMalloc(&split_counters_, sizeof(int32_t) * counter_capacity_));
    FULCRUM_CUDA_CHECK(cudaMemset(split_counters_, 0, sizeof(int32_t) * counter_capacity_));
  }
  ~OwnAttention() override {
    if (workspace_ != nullptr) cudaFree(workspace_);
    if (split_counters_ != nullptr) cudaFree(split_counters_);
  }
  OwnAttention(const OwnAttention&) = delete;
  OwnAttention& operator=(const OwnAttention&) = delete;
  std::string name() const override { return plan_.tensor_cores ? "fulcrum (tensor cores)" : "fulcrum (CUDA cores)"; }

  bool graph_safe() const override { return true; }

  void plan(const StepArrays& /*host*/, const StepShape& shape, bool for_graph, CUstream_st* /*stream*/) override {
    PagedAttentionShape s;
    s.num_seqs = shape.num_seqs;
    s.num_tokens = static_cast<int>(shape.num_tokens);
    s.num_heads = config_.num_attention_heads;
    s.num_kv_heads = config_.num_key_value_heads;
    s.head_dim = config_.head_dim;
    // Decode steps plan for their bucket, graphs or not, so an eager decode step is the graph's twin bit for bit.
    s.max_kv_len = static_cast<int>(shape.decode_only ? decode_bucket(shape.max_kv_len) : shape.max_kv_len);
    s.max_q_len = shape.decode_only ? 1 : -1;
    s.num_sms = num_sms_;
    s.max_cluster = max_cluster_;
    (void)for_graph;
    plan_ = plan_paged_attention(s);
    const size_t need = paged_attention_workspace_bytes(plan_);
    if (need > workspace_bytes_) {
      if (workspace_ != nullptr) FULCRUM_CUDA_CHECK(cudaFree(workspace_));  // waits for the device
      FULCRUM_CUDA_CHECK(cudaMalloc(&workspace_, need));
      workspace_bytes_ = need;
      ++epoch_;
    }
  }

  void run(const AttentionBatch& batch, CUstream_st* stream) override {
    FULCRUM_CHECK(static_cast<int64_t>(batch.num_seqs) * batch.num_kv_heads <= counter_capacity_,
                  "GPU attention: {} sequences, the runner was made for at most {}", batch.num_seqs,
                  counter_capacity_ / std::max(1, batch.num_kv_heads));
    AttentionBatch with_counters = batch;
    with_counters.split_counters = split_counters_;
    const cudaError_t status = launch_paged_attention(with_counters, plan_, workspace_, workspace_bytes_, stream);
    FULCRUM_CHECK(status == cudaSuccess, "GPU attention: {}", cudaGetErrorString(status));
  }

 private:
  model::Qwen3MoeConfig config_;
  int num_sms_ = 0;
  int max_cluster_ = kPagedAttentionPortableCluster;
  PagedAttentionPlan plan_;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  int32_t* split_counters_ = nullptr;
  int64_t counter_capacity_ = 0;
};

// FlashInfer (head_dim 128): its SM90 kernel for steps with prefill chunks, its tensor-core decode otherwise.
// A FlashInfer plan is the step's own (its kernel's schedule is rebuilt per step), so its steps run eagerly;
// in "auto" it takes only the steps with prefill chunks and decode steps go to the engine's kernels (graphs).
class FlashInferRunner final : public AttentionRunner {
 public:
  FlashInferRunner(const model::Qwen3MoeConfig& config, int page_size, int64_t max_tokens, int max_seqs, int device_idx,
                   bool decode_too)
      : own_(config, max_seqs, device_idx),
        fi_(config.num_attention_heads, config.num_key_value_heads, config.head_dim, page_size,
            static_cast<int>(max_tokens), max_seqs, device_idx),
        decode_too_(decode_too) {}
  std::string name() const override { return decode_too_ ? "flashinfer" : "flashinfer prefill + " + own_.name() + " decode"; }
  bool graph_safe() const override { return !use_fi_; }
  void plan(const StepArrays& host, const StepShape& shape, bool for_graph, CUstream_st* stream) override {
    use_fi_ = decode_too_ || !shape.decode_only;
    if (!use_fi_) {
      own_.plan(host, shape, for_graph, stream);
      epoch_ = own_.epoch();
      return;
    }
    const auto s = static_cast<size_t>(shape.num_seqs);
    fi_.plan({host.q_indptr, s + 1}, {host.kv_page_indptr, s + 1}, {host.kv_len, s}, false, stream);
  }
  void run(const AttentionBatch& batch, CUstream_st* stream) override {
    if (use_fi_) {
      fi_.run(batch, stream);
    } else {
      own_.run(batch, stream);
    }
  }

 private:
  OwnAttention own_;
  FlashInferAttention fi_;
  bool decode_too_ = false;
  bool use_fi_ = false;
};

bool flashinfer_applies(const model::Qwen3MoeConfig& config, int device_idx) {
  cudaDeviceProp prop{};
  FULCRUM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_idx));
  return prop.major == 9 &&
         FlashInferAttention::supports(config.head_dim, config.num_attention_heads, config.num_key_value_heads);
}

}  // namespace

std::unique_ptr<AttentionRunner> make_attention_runner(const std::string& which, const model::Qwen3MoeConfig& config,
                                                       int page_size, int64_t max_tokens, int max_seqs, int device_idx) {
  FULCRUM_CHECK(which == "auto" || which == "fulcrum" || which == "flashinfer",
                "--attention must be auto, fulcrum or flashinfer, got '{}'", which);
  if (which == "fulcrum" || (which == "auto" && !flashinfer_applies(config, device_idx))) {
    return std::make_unique<OwnAttention>(config, max_seqs, device_idx);
  }
  FULCRUM_CHECK(flashinfer_applies(config, device_idx),
                "--attention flashinfer: FlashInfer's kernels here need head_dim 128, at most 16 q heads per kv head and "
                "an sm_90 GPU (head_dim {}, {} q / {} kv heads)",
                config.head_dim, config.num_attention_heads, config.num_key_value_heads);
  return std::make_unique<FlashInferRunner>(config, page_size, max_tokens, max_seqs, device_idx, which == "flashinfer");
}

}  // namespace fulcrum::gpu
