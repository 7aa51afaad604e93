#pragma once
// The engine's attention over one step's ragged batch behind one interface: a host plan from the step's
// shape (and, for FlashInfer, its host page tables), then an enqueue-only run per layer that a CUDA graph can
// capture. Implementations: the engine's own kernels (kernels/paged_attention.hpp, every head_dim) and the
// FlashInfer wrapper (flashinfer/flashinfer_attention.hpp, head_dim 128). No CUDA header here.
#include <cstdint>
#include <memory>
#include <string>

#include "gpu/kernels/attention_batch.hpp"
#include "gpu/step_inputs.hpp"
#include "model/qwen3_config.hpp"

struct CUstream_st;

namespace fulcrum::gpu {

class AttentionRunner {
 public:
  virtual ~AttentionRunner() = default;
  virtual std::string name() const = 0;
  // The KV-length bucket a decode step's graph is keyed by: steps of one bucket share one plan.
  static int64_t decode_bucket(int64_t max_kv_len);
  int64_t graph_bucket(const StepShape& shape) const { return decode_bucket(shape.max_kv_len); }
  // Host side, before the step's launches (and before each replay of a graph): `host` are the step's inputs as
  // packed on the host. for_graph: the plan must be the bucket's (the same for every step of the bucket).
  virtual void plan(const StepArrays& host, const StepShape& shape, bool for_graph, CUstream_st* stream) = 0;
  // Whether the planned step's launches may be captured in a CUDA graph and replayed across steps of its bucket.
  virtual bool graph_safe() const = 0;
  // Changes whenever plan() moved a buffer the launches read: graphs captured before are stale then.
  int64_t epoch() const { return epoch_; }
  // Enqueues attention for one layer of the planned step.
  virtual void run(const AttentionBatch& batch, CUstream_st* stream) = 0;

 protected:
  int64_t epoch_ = 0;
};

// "fulcrum": the engine's kernels; "flashinfer": FlashInfer (refused where it does not apply); "auto": FlashInfer
// where it applies, else the engine's kernels.
std::unique_ptr<AttentionRunner> make_attention_runner(const std::string& which, const model::Qwen3MoeConfig& config,
                                                       int page_size, int64_t max_tokens, int max_seqs, int device_idx);

}  // namespace fulcrum::gpu
