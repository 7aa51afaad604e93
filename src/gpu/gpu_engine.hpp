#pragma once
// The GPU engine: the whole Qwen3-MoE step on one device, the fast implementation of model::StepModel (the CPU
// reference is the parallel engine behind server::EngineStepExecutor). A step is a ragged batch of prefill
// chunks and decode tokens in, sampled tokens out:
//   host: validate, pack the step's inputs (token ids, positions, KV rows, page tables, sampling rows) into one
//         pinned buffer -> one copy to the device
//   device, no host synchronization inside: embedding -> per layer [add + RMSNorm -> QKV GEMM -> q/k RMSNorm +
//         RoPE + paged KV append -> paged attention over the whole batch -> O GEMM -> add + RMSNorm -> MoE layer
//         (router, recorder, replica choice, permutation, expert GEMMs, combine) or dense SwiGLU MLP] -> final
//         add + RMSNorm of the rows that sample -> LM head -> sampler; then, in a step whose entries ask for
//         prompt logprobs (StepSequence::prompt_targets), final add + RMSNorm + LM head of those prompt rows
//   host: one copy of the sampled tokens (and logprobs; top logprobs, sampler_top_logprobs.hpp, when a row
//         asks) back, the only wait of the step; prompt rows' log-softmax values are taken on the device by the
//         same kernel (the target in place of the sampled token) and come back with them.
// Decode steps (every sequence one new token) replay a CUDA graph captured per (batch size, KV-length bucket);
// prefill and mixed steps, and every step with prompt rows, run eagerly. Weights are bf16 (FP8 checkpoints: experts
// and, where their shapes allow, dense projections e4m3 with 128x128 scales), the residual stream fp32, KV pages bf16.
// No CUDA header here.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/device_exchange.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "eplb/dispatch.hpp"
#include "eplb/placement.hpp"
#include "gpu/device_kv_pool.hpp"
#include "gpu/device_weights.hpp"
#include "gpu/step_inputs.hpp"
#include "model/qwen3_config.hpp"
#include "model/safetensors.hpp"
#include "model/step_model.hpp"

struct CUstream_st;

namespace fulcrum::backend {
class EpMoeLayer;
class GpuMoeLayer;
}

namespace fulcrum::gpu {

class AttentionRunner;
class DenseGemm;
struct GraphCache;

struct GpuEngineOptions {
  int device = 0;
  int64_t max_batch_tokens = 8192;  // new tokens of one step, over all its sequences
  int max_batch_seqs = 256;         // sequences of one step
  int page_size = 16;
  int64_t kv_pages = 0;             // 0: kv_memory_fraction of the memory free after weights and workspace
  double kv_memory_fraction = 0.9;
  bool cuda_graphs = true;          // decode steps replay captured graphs
  std::string attention = "auto";   // auto | fulcrum | flashinfer (auto: FlashInfer where it applies)
  eplb::Placement placement;        // expert slots of the MoE layers (all on this GPU); empty: trivial
  eplb::DispatchAlgorithm dispatch = eplb::DispatchAlgorithm::kStatic;
  uint64_t dispatch_seed = 0x5eed;
  // MoE steps of at most this many entries (tokens x top-k) run the skinny expert path (backend::GpuMoeLayer;
  // 0: never), the rest CUTLASS's grouped GEMMs.
  int64_t skinny_max_entries = backend::kDefaultSkinnyMaxEntries;
  // FP8 checkpoints: keep the dense projections (qkv, o, dense MLP) FP8 on the device too, half their bytes,
  // where the 128 rule allows (DeviceWeights). Off (the default): dequantized to bf16. On one H200 the FP8 dense
  // GEMMs win at 1 and 4 rows and lose from 8, so decode of 16+ sequences and prefill are faster with bf16 copies
  // (docs/benchmarks.md, "FP8 dense projections"). `--fp8-dense-gemms`.
  bool fp8_dense_gemms = false;
  // Record each step's device times (last_step_device_times; three CUDA events a step): for benchmarks, off in serving.
  bool time_steps = false;
  // Expert parallelism (not owned; null: every slot on this GPU). This engine is EP rank ep->rank() of ep->size():
  // the placement's topology has that many GPUs, this one holds the P / G slots [rank * P / G, (rank + 1) * P / G)
  // of each MoE layer and the whole rest of the model, and runs its own sequences (data-parallel attention). Its
  // MoE layers are backend::EpMoeLayer: each exchanges the rows routed to other ranks' slots through `ep` (NCCL
  // across GPUs, comm::HostStagedExchange for ranks sharing one), so every rank must call step() / forward_logits()
  // together, as many times, a rank without sequences with an empty batch (it joins each layer's exchange with no
  // tokens). Steps run eagerly (the exchange waits on the host); bf16 experts; no weight cache, no live placement.
  comm::DeviceExchange* ep = nullptr;
};

class GpuEngine final : public model::StepModel {
 public:
  // Allocates weights (contents undefined until load / fill_random), KV pool and workspaces; one-line errors
  // when the GPU is missing or the model, the pool or the workspace do not fit.
  GpuEngine(const model::Qwen3MoeConfig& config, GpuEngineOptions options);
  ~GpuEngine() override;
  GpuEngine(const GpuEngine&) = delete;
  GpuEngine& operator=(const GpuEngine&) = delete;

  void load(model::Checkpoint& checkpoint, const std::function<void(int, int)>& on_layer = {});
  void fill_random(uint64_t seed);
  // `--weight-cache`: with a cache_dir holding this engine's cache (DeviceWeights::cache_file), loads it (true);
  // else loads the checkpoint in model_dir and, with a cache_dir, writes the cache for the next start (false).
  bool load_weights(const std::string& model_dir, const std::string& cache_dir,
                    const std::function<void(int, int)>& on_layer = {});

  int vocab_size() const override { return config_.vocab_size; }
  int64_t max_sequence_length() const override;
  void allocate(model::SequenceId id, int64_t capacity) override;
  void allocate_on_pages(model::SequenceId id, const model::SequencePages& pages) override;
  void release(model::SequenceId id) override;
  model::StepOutput step(std::span<const model::StepSequence> batch) override;
  // Prompt logprobs: the LM head also runs over each entry's prompt rows (eager steps; the head's buffers are
  // allocated at construction, so nothing is allocated per step).
  bool supports_prompt_logprobs() const override { return true; }

  // Logits [new tokens, vocab] of every new token of every entry, fp32 on the host: an eager forward that
  // samples nothing (tests, --dump-logits). Advances the caches like step().
  std::vector<model::HostTensor> forward_logits(std::span<const model::StepSequence> batch);

  // Benchmarks: pseudo-random bf16 values in every KV page, then `assume_prefilled` marks the first
  // `num_tokens` positions of a live sequence as written without computing them, so a decode at a long
  // context is timed without its prefill (attention's speed does not depend on the values).
  void fill_kv_random(uint64_t seed);
  void assume_prefilled(model::SequenceId id, int64_t num_tokens);

  // Live EPLB: the MoE layers take `next` (the same layers, experts and slot count, on this engine's GPU count: one,
  // or the EP ranks). Per layer whose row changes, each slot whose expert changes receives it (weights and FP8
  // scales, one blob each) into a spare buffer of the slot pool, by a device copy from a slot of this GPU that holds
  // it now or, on EP ranks, through the exchange from the rank that does, and is remapped to it; on EP ranks it is
  // collective (every rank calls it with the same placement, between the same steps);
  // the layer's slot pointers and dispatch tables are rewritten in place, so decode graphs captured before keep
  // replaying (the dispatch algorithm and its sources stay those of the options, so the tables keep their sizes).
  // Between steps (it waits for the engine's stream). Returns the slots that moved. A placement of another shape
  // or an invalid one (an expert without a slot) is a one-line error before anything moves; a device error
  // after a layer's slots moved leaves the engine refusing every later step (rebuild it).
  int64_t apply_placement(const eplb::Placement& next);
  // The placement the slots hold now (options().placement is the one the engine started with).
  const eplb::Placement& placement() const { return weights_->placement(); }

  // Routed tokens per (MoE layer, logical expert) since construction or the last reset: [moe_layers * E].
  std::vector<int64_t> expert_counts();
  void reset_expert_counts();

  const model::Qwen3MoeConfig& config() const { return config_; }
  const GpuEngineOptions& options() const { return options_; }
  const DeviceWeights& weights() const { return *weights_; }
  const DeviceKvPool& kv_pool() const { return *kv_; }
  std::string attention_name() const;
  int64_t workspace_bytes() const { return workspace_bytes_; }
  struct Counters {
    int64_t eager_steps = 0, graph_replays = 0, graph_captures = 0;
  };
  const Counters& counters() const { return counters_; }
  // With options().time_steps, the last step on the device, from CUDA events on the engine's stream (ms): `span`
  // from the input upload to the last copy back, `forward` from the first launch of the forward (graph or eager) to
  // the last copy back. Beside the host's time of step(), what is left is host work between steps (packing,
  // planning, launching, waking up).
  struct DeviceTimes {
    double span_ms = 0, forward_ms = 0;
  };
  DeviceTimes last_step_device_times() const { return last_device_times_; }

 private:
  struct Workspace;
  StepShape pack(std::span<const model::StepSequence> batch, bool sample_every_row);
  void plan_attention(const StepShape& shape);
  void forward_layers(const StepShape& shape);
  void head(const int32_t* rows, int num_rows, float* logits);
  // residual += the last layer output (delta, or the pending MoE combine), then RMSNorm of `rows` into out;
  // keep_pending: the pending combine serves later calls too (the head's row chunks, distinct rows each).
  void add_norm(bool with_delta, const uint16_t* weight, const int32_t* rows, int64_t num_rows, uint16_t* out,
                const char* what, bool keep_pending = false);
  void sample(const StepShape& shape);
  // ws_->head_rows [0, num_rows) <- its pinned host twin (filled by the caller since the last wait), and with
  // targets, ws_->prompt_targets [0, num_rows) <- theirs.
  void upload_head_rows(int64_t num_rows, bool targets = false);
  // The LM head over the token rows ws_->head_rows [0, num_rows), logit_rows at a time through ws_->logits,
  // into host_logits [num_rows, V] (enqueued; valid after the stream's next wait). Eager only: it rewrites
  // ws_->logits, so it follows whatever reads the sampled rows' logits.
  void head_rows_to_host(int64_t num_rows, float* host_logits);
  // The LM head over the prompt rows ws_->head_rows [0, num_rows) the same way, each chunk's log-softmax values
  // of its targets and num_top best tokens by launch_top_logprobs (the targets standing for sampled tokens), and
  // those values to ws_->prompt_out_host: [num_rows] logprob bits, [num_rows, num_top] ids, [num_rows, num_top]
  // logprob bits (enqueued; valid after the stream's next wait). Eager only, as head_rows_to_host.
  void prompt_logprobs_to_host(int64_t num_rows, int num_top);
  void run_decode_graph(const StepShape& shape);
  // An EP rank's step without sequences: every MoE layer joins its exchange with no tokens.
  void join_exchanges_without_tokens();
  int num_moe_layers() const { return static_cast<int>(config_.moe_layer_indices().size()); }
  int ep_size() const { return options_.ep != nullptr ? options_.ep->size() : 1; }  // EP ranks (1: one GPU)
  void point_moe_layer_at_slots(int moe_layer);
  void advance(std::span<const model::StepSequence> batch);

  model::Qwen3MoeConfig config_;
  GpuEngineOptions options_;
  CUstream_st* stream_ = nullptr;
  std::unique_ptr<DeviceWeights> weights_;
  std::unique_ptr<DeviceKvPool> kv_;
  std::unique_ptr<Workspace> ws_;
  std::unique_ptr<DenseGemm> gemm_;
  std::unique_ptr<AttentionRunner> attention_;
  std::vector<std::unique_ptr<backend::GpuMoeLayer>> moe_;  // per MoE layer ordinal (one GPU)
  std::vector<std::unique_ptr<backend::EpMoeLayer>> ep_moe_;  // per MoE layer ordinal (options_.ep: instead of moe_)
  std::unique_ptr<GraphCache> graphs_;
  StepCapacity capacity_;
  StepLayout layout_;
  int64_t workspace_bytes_ = 0;
  Counters counters_;
  DeviceTimes last_device_times_;
  // Set when apply_placement failed after moving a layer's slots (the layer may read freed buffers): every later
  // step and placement is refused with it.
  std::string broken_placement_;
  // The MoE layer whose combine the next add_norm fuses (null: the delta buffer holds the layer output).
  backend::GpuMoeLayer* pending_combine_ = nullptr;
};

}  // namespace fulcrum::gpu
