#include "server/gpu_step_executor.hpp"

#include <fmt/format.h>

#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "gpu/gpu_engine.hpp"

namespace fulcrum::server {

// The device recorder's counts since start(): the engine counts all the time; start takes a baseline.
class GpuStepExecutor::Recorder final : public ExpertDistributionRecorder {
 public:
  Recorder(GpuStepExecutor& owner) : owner_(owner) {}
  void start() override {
    std::lock_guard lock(owner_.mutex_);
    baseline_ = owner_.engine_->expert_counts();
    recording_ = true;
  }
  void stop() override {
    std::lock_guard lock(owner_.mutex_);
    if (recording_) final_ = since_start();
    recording_ = false;
  }
  bool recording() const override { return recording_; }
  nlohmann::json dump(const std::string& path) override {
    std::vector<int64_t> counts;
    {
      std::lock_guard lock(owner_.mutex_);
      counts = recording_ ? since_start() : final_;
    }
    const model::Qwen3MoeConfig& c = owner_.engine_->config();
    const auto layers = c.moe_layer_indices().size();
    counts.resize(layers * static_cast<size_t>(c.num_experts), 0);
    nlohmann::json rows = nlohmann::json::array();
    int64_t tokens = 0;
    for (size_t l = 0; l < layers; ++l) {
      const auto begin = counts.begin() + static_cast<ptrdiff_t>(l * c.num_experts);
      rows.push_back(std::vector<int64_t>(begin, begin + c.num_experts));
      if (l == 0) {
        for (auto it = begin; it != begin + c.num_experts; ++it) tokens += *it;
        tokens /= std::max(1, c.num_experts_per_tok);
      }
    }
    nlohmann::json doc{{"logical_count", rows}, {"num_tokens", tokens}, {"recording", recording_.load()}};
    if (!path.empty()) write_file_atomically(path, doc.dump() + "\n");
    return doc;
  }

 private:
  std::vector<int64_t> since_start() {  // under the owner's mutex
    std::vector<int64_t> now = owner_.engine_->expert_counts();
    for (size_t i = 0; i < now.size() && i < baseline_.size(); ++i) now[i] -= baseline_[i];
    return now;
  }
  GpuStepExecutor& owner_;
  std::atomic<bool> recording_{false};
  std::vector<int64_t> baseline_, final_;
};

bool serves_on_gpu(const engine::ParallelFlags& p, const engine::InProcessRun& run) {
  return run.device == "cuda" && p.tp == 1 && p.pp == 1 && p.ep == 1 && p.dp == 1;
}

GpuStepExecutor::GpuStepExecutor(const GpuExecutorOptions& options) {
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(options.model_dir);
  const engine::ParallelLayout layout(options.parallel, config);
  gpu::GpuEngineOptions eo;
  eo.placement = engine::prepare_in_process_run(config, layout, options.run);
  eo.dispatch = options.run.engine.dispatch_algorithm;
  eo.dispatch_seed = options.run.engine.dispatch_seed;
  eo.fp8_dense_gemms = options.run.fp8_dense_gemms;
  eo.kv_pages = options.scheduler.kv_pages;
  eo.page_size = options.scheduler.page_size;
  eo.max_batch_seqs = options.scheduler.max_running_requests;
  // A step holds every running decode plus at most max_prefill_tokens of prompt chunks.
  eo.max_batch_tokens = int64_t{options.scheduler.max_running_requests} + options.scheduler.max_prefill_tokens;
  engine_ = std::make_unique<gpu::GpuEngine>(config, eo);
  if (options.random_weights) {
    engine_->fill_random(0x5eed);
  } else {
    engine_->load_weights(options.model_dir, options.run.weight_cache_dir, options.on_layers_loaded);
  }
  recorder_ = std::make_unique<Recorder>(*this);
}

GpuStepExecutor::~GpuStepExecutor() = default;

ExpertDistributionRecorder* GpuStepExecutor::recorder() { return recorder_.get(); }

int GpuStepExecutor::vocab_size() const { return engine_->vocab_size(); }
bool GpuStepExecutor::supports_prompt_logprobs() const { return engine_->supports_prompt_logprobs(); }
int64_t GpuStepExecutor::max_sequence_length() const { return engine_->max_sequence_length(); }
const model::Qwen3MoeConfig& GpuStepExecutor::config() const { return engine_->config(); }

std::string GpuStepExecutor::describe() const {
  return fmt::format("the GPU engine (GPU {}, attention {}, {:.2f} GiB of weights)", engine_->options().device,
                     engine_->attention_name(), engine_->weights().bytes() / (1024.0 * 1024.0 * 1024.0));
}

void GpuStepExecutor::allocate(SequenceId id, int64_t capacity) {
  std::lock_guard lock(mutex_);
  engine_->allocate(id, capacity);
}

void GpuStepExecutor::allocate_on_pages(SequenceId id, const model::SequencePages& pages) {
  std::lock_guard lock(mutex_);
  engine_->allocate_on_pages(id, pages);
}

void GpuStepExecutor::release(SequenceId id) {
  std::lock_guard lock(mutex_);
  engine_->release(id);
}

model::StepOutput GpuStepExecutor::step(std::span<const model::StepSequence> batch) {
  std::lock_guard lock(mutex_);
  return engine_->step(batch);
}

}  // namespace fulcrum::server
