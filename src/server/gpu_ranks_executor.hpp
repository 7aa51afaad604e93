#pragma once
// StepExecutor over W GPU engines as expert-parallel ranks (gpu::GpuEngineOptions::ep) for `serve --device cuda
// --tp W --dp W --enable-dp-attention --ep W` on one node: rank r, a thread of this process on GPU r % (visible GPUs),
// holds P / W expert slots of every MoE layer and attention-DP group r's sequences and KV pool (num_kv_groups() = W;
// the scheduler picks each sequence's group). A step splits the batch by group and runs every rank's part in lockstep
// (a rank without entries joins each MoE layer's exchange with an empty batch); the MoE rows move between ranks
// through host memory (comm::HostStagedExchange). Steps run eagerly. With --enable-eplb each rank runs
// gpu::GpuRankEplb after every step (rebalances every --eplb-rebalance-num-iterations steps, slots moving rank to rank
// through the same exchange between two steps; rank 0 reports to the server's metrics). A step that fails on a rank ends the ranks
// (its exchanges could not complete): that step and every later call throw ExecutorFailure.
// Built with CUDA only (src/cuda/CMakeLists.txt adds it).
#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "server/gpu_step_executor.hpp"

namespace fulcrum::server {

class GpuRanksExecutor final : public StepExecutor {
 public:
  // options.parallel: tp = dp = ep = W > 1 with DP attention, pp = 1 (engine::runs_gpu_engine_ranks); one-line errors otherwise,
  // and when a rank's engine cannot be built (every rank then stops).
  explicit GpuRanksExecutor(const GpuExecutorOptions& options);
  ~GpuRanksExecutor() override;

  int vocab_size() const override;
  int64_t max_sequence_length() const override;
  int num_kv_groups() const override { return world_size_; }
  void allocate(SequenceId id, int64_t capacity) override;
  void allocate_on_pages(SequenceId id, const model::SequencePages& pages) override;
  void release(SequenceId id) override;
  model::StepOutput step(std::span<const model::StepSequence> batch) override;
  bool supports_prompt_logprobs() const override { return true; }

  const model::Qwen3MoeConfig& config() const { return config_; }
  std::string describe() const;
  ExpertDistributionRecorder* recorder() { return recorder_.get(); }

 private:
  struct Rank;
  using Task = std::function<void(gpu::GpuEngine&)>;
  using RankTask = std::function<void(int rank, gpu::GpuEngine&)>;
  // Runs task(rank, engine) on each listed rank's thread concurrently and waits; collective: a failure ends the
  // ranks. Returns the first failure's message (empty: none).
  std::string run_on(const std::vector<int>& ranks, const RankTask& task, bool collective);
  std::string run_on_all(const RankTask& task, bool collective);
  void run_one(int rank, const Task& task);  // not collective; rethrows the task's error
  void rank_main(int rank, comm::Communicator& comm, const GpuExecutorOptions& options, const gpu::GpuEngineOptions& base);
  void stop_ranks();
  bool stopping();
  // On rank r's thread after its step: the rank's live EPLB (collective when a rebalance is due); rank 0 reports
  // rebalances and balancedness to metrics_.
  void after_step(int r);

  model::Qwen3MoeConfig config_;
  int world_size_ = 0;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::thread world_;             // comm::run_in_process over the ranks' threads
  std::mutex state_mutex_;        // stopping_, ready_, failure_
  std::condition_variable state_cv_;
  bool stopping_ = false;
  int ready_ = 0;
  std::string failure_;           // why the ranks stopped (empty while they run)
  std::mutex mutex_;              // the scheduler's calls and the endpoints' counter reads
  std::map<SequenceId, int> group_of_;  // each live sequence's rank
  std::string description_;
  int64_t max_sequence_length_ = 0;
  std::unique_ptr<GpuCountsRecorder> recorder_;
  ServerMetrics* metrics_ = nullptr;
};

}  // namespace fulcrum::server
