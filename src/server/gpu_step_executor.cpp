#include "server/gpu_step_executor.hpp"

#include <fmt/format.h>

#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "gpu/gpu_engine.hpp"

namespace fulcrum::server {

GpuCountsRecorder::GpuCountsRecorder(std::mutex& mutex, const model::Qwen3MoeConfig& config,
                                     std::function<std::vector<int64_t>()> counts)
    : mutex_(mutex), config_(config), counts_(std::move(counts)) {}

void GpuCountsRecorder::start() {
  std::lock_guard lock(mutex_);
  baseline_ = counts_();
  recording_ = true;
}

void GpuCountsRecorder::stop() {
  std::lock_guard lock(mutex_);
  if (recording_) final_ = since_start();
  recording_ = false;
}

nlohmann::json GpuCountsRecorder::dump(const std::string& path) {
  std::vector<int64_t> counts;
  {
    std::lock_guard lock(mutex_);
    counts = recording_ ? since_start() : final_;
  }
  const model::Qwen3MoeConfig& c = config_;
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

std::vector<int64_t> GpuCountsRecorder::since_start() {
  std::vector<int64_t> now = counts_();
  for (size_t i = 0; i < now.size() && i < baseline_.size(); ++i) now[i] -= baseline_[i];
  return now;
}

bool serves_on_gpu(const engine::ParallelFlags& p, const engine::InProcessRun& run) {
  return run.device == "cuda" && p.tp == 1 && p.pp == 1 && p.ep == 1 && p.dp == 1;
}

gpu::GpuEngineOptions gpu_engine_options(const GpuExecutorOptions& options, const model::Qwen3MoeConfig& config) {
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
  return eo;
}

void fill_gpu_engine(gpu::GpuEngine& engine, const GpuExecutorOptions& options, bool report_progress) {
  if (options.random_weights) {
    engine.fill_random(0x5eed);
  } else {
    engine.load_weights(options.model_dir, options.run.weight_cache_dir,
                        report_progress ? options.on_layers_loaded : std::function<void(int, int)>{});
  }
}

GpuStepExecutor::GpuStepExecutor(const GpuExecutorOptions& options) {
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(options.model_dir);
  engine_ = std::make_unique<gpu::GpuEngine>(config, gpu_engine_options(options, config));
  fill_gpu_engine(*engine_, options, /*report_progress=*/true);
  recorder_ = std::make_unique<GpuCountsRecorder>(mutex_, engine_->config(), [this] { return engine_->expert_counts(); });
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
