#pragma once
// StepExecutor over the GPU engine (src/gpu/gpu_engine.hpp) for `serve --device cuda` on one GPU: the model's
// whole step on the device, sampling included; the expert-distribution endpoints read the engine's device
// recorder (once per request, not per step). Built with CUDA only (src/cuda/CMakeLists.txt adds it).
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "engine/parallel_generate.hpp"
#include "server/expert_distribution.hpp"
#include "server/scheduler.hpp"
#include "server/step_executor.hpp"

namespace fulcrum::gpu {
class GpuEngine;
struct GpuEngineOptions;
}

namespace fulcrum::server {

class ServerMetrics;

struct GpuExecutorOptions {
  std::string model_dir;
  engine::ParallelFlags parallel;  // must be one rank
  engine::InProcessRun run;        // initial placement, replica choice (EPLB needs several ranks)
  SchedulerOptions scheduler;      // KV pages and page size, step capacity
  std::function<void(int done, int total)> on_layers_loaded;
  bool random_weights = false;  // --load-format dummy: device-generated weights, no checkpoint read
  ServerMetrics* metrics = nullptr;  // the EP ranks' live EPLB reports its rebalances and balancedness here
};

// The expert-distribution endpoints over GPU engines' device recorders: `counts` gives [MoE layers * E] routed tokens
// since the engines started (summed over an executor's engines), read under `mutex`, the executor's; start() takes a
// baseline, so a dump holds the counts since then (once per request, never per step).
class GpuCountsRecorder final : public ExpertDistributionRecorder {
 public:
  GpuCountsRecorder(std::mutex& mutex, const model::Qwen3MoeConfig& config, std::function<std::vector<int64_t>()> counts);
  void start() override;
  void stop() override;
  bool recording() const override { return recording_; }
  nlohmann::json dump(const std::string& path) override;

 private:
  std::vector<int64_t> since_start();  // under mutex_
  std::mutex& mutex_;
  model::Qwen3MoeConfig config_;
  std::function<std::vector<int64_t>()> counts_;
  std::atomic<bool> recording_{false};
  std::vector<int64_t> baseline_, final_;
};

class GpuStepExecutor final : public StepExecutor {
 public:
  explicit GpuStepExecutor(const GpuExecutorOptions& options);
  ~GpuStepExecutor() override;

  int vocab_size() const override;
  int64_t max_sequence_length() const override;
  void allocate(SequenceId id, int64_t capacity) override;
  void allocate_on_pages(SequenceId id, const model::SequencePages& pages) override;
  void release(SequenceId id) override;
  model::StepOutput step(std::span<const model::StepSequence> batch) override;
  bool supports_prompt_logprobs() const override;  // gpu::GpuEngine's

  const model::Qwen3MoeConfig& config() const;
  std::string describe() const;  // for the server's start line
  ExpertDistributionRecorder* recorder();

 private:
  std::mutex mutex_;  // the scheduler's steps and the endpoints' counter reads
  std::unique_ptr<gpu::GpuEngine> engine_;
  std::unique_ptr<GpuCountsRecorder> recorder_;
};

// The GPU engine's options for serving (placement, dispatch, the scheduler's KV pool and step capacity), and its
// weights: the checkpoint (or the weight cache), or with random_weights device-generated ones; report_progress calls
// on_layers_loaded.
gpu::GpuEngineOptions gpu_engine_options(const GpuExecutorOptions& options, const model::Qwen3MoeConfig& config);
void fill_gpu_engine(gpu::GpuEngine& engine, const GpuExecutorOptions& options, bool report_progress);

// Whether `serve` runs on the GPU engine: --device cuda on one rank.
bool serves_on_gpu(const engine::ParallelFlags& parallel, const engine::InProcessRun& run);

}  // namespace fulcrum::server
