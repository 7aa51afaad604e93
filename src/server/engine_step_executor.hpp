#pragma once
// StepExecutor over the parallel engine (src/engine): the world's ranks run as persistent in-process
// threads (engine::RankThreads), each with its own backend, RankEngine and, when routing is recorded,
// RankEplb (live EPLB with --enable-eplb). One rank (tp = ep = pp = 1) is the plain single-model case.
//
//   allocate / release  add / drop the sequence on every rank (RankEngine::add_sequence picks its
//                       attention-DP group for its life); releases travel with the next command.
//                       allocate_on_pages: the caller (the scheduler's prefix cache) picks group and pages.
//   step                one collective forward pass (last-position logits, rank 0's), then the EPLB step
//                       on every rank; each entry that asks is sampled from rank 0's row on the caller's
//                       thread (model::sample_entry). A sequence's logits depend only on its own tokens.
//   EPLB                rebalance lines go to `log`; ServerMetrics gets rebalances, bytes migrated and the
//                       balancedness of the live placement on the recorder's window (merged over ranks),
//                       refreshed after every rebalance, every layer switch and every kRefreshPasses passes.
//   endpoints           recorder() counts every rank's routing (each token once) for /start_, /stop_ and
//                       /dump_expert_distribution_record.
// A failure on any rank aborts the world (no hang) and step() throws ExecutorFailure with its message.
//
// Ranks as processes (serve --multi-process, options.process_world): this object holds only its own
// process's rank. On world rank 0 (the front end) every call above becomes a RankCommand (rank_command.hpp)
// broadcast to the other ranks before this rank runs it; on the others serve_as_worker() runs the same
// commands as they come. Their routing counts reach rank 0's recorder after each pass while it records.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/parallel_generate.hpp"
#include "engine/rank_threads.hpp"
#include "server/expert_distribution.hpp"
#include "server/metrics.hpp"
#include "server/rank_command.hpp"
#include "server/step_executor.hpp"

namespace fulcrum::server {

struct EngineExecutorOptions {
  std::string model_dir;
  engine::ParallelFlags parallel;
  engine::InProcessRun run;  // device, weight cache, initial placement, dispatch, EPLB (decode and dump unused)
  ServerMetrics* metrics = nullptr;                   // EPLB gauges; may be null
  std::function<void(const std::string&)> log;        // EPLB lines (world rank 0); empty: stderr
  // Weight loading progress over the world: layers loaded on all ranks so far, of the sum of every rank's
  // owned layers. Called from rank threads, serialized.
  std::function<void(int done, int total)> on_layers_loaded;
  // Each rank's KV pool, fixed at load (Qwen3MoeModel::reserve_kv_pool): the scheduler's pages, so a rank
  // never runs short whatever attention-DP group its sequences join. 0: the pool grows as needed.
  int64_t kv_pages = 0;
  int page_size = 16;
  // Set: ranks as processes, this process being rank process_world->rank() (it must outlive the executor).
  comm::Communicator* process_world = nullptr;
};

class EngineStepExecutor final : public StepExecutor {
 public:
  static constexpr int kRefreshPasses = 16;

  // Reads the config, builds the layout (one-line errors for impossible ones) and loads every rank.
  explicit EngineStepExecutor(EngineExecutorOptions options);
  ~EngineStepExecutor() override;

  int vocab_size() const override { return config_.vocab_size; }
  int64_t max_sequence_length() const override;
  void allocate(SequenceId id, int64_t capacity) override;
  void allocate_on_pages(SequenceId id, const model::SequencePages& pages) override;
  int num_kv_groups() const override { return layout_->attn_dp_size(); }
  void release(SequenceId id) override;
  model::StepOutput step(std::span<const model::StepSequence> batch) override;

  const model::Qwen3MoeConfig& config() const { return config_; }
  const engine::ParallelLayout& layout() const { return *layout_; }
  bool eplb_enabled() const { return options_.run.eplb.enabled; }
  // Null for a model without MoE layers.
  ExpertDistributionRecorder* recorder() { return recorder_.get(); }

  // Ranks as processes, on a rank other than 0: runs world rank 0's commands until it says stop.
  void serve_as_worker();

 private:
  struct Capacity {
    int64_t capacity = 0;
    int64_t num_tokens = 0;
  };
  // Runs `add` (kAdd or kAddOnPages) on every rank after the pending releases; undoes it on a failure.
  void add_on_ranks(RankCommand add);
  void run_pass(const RankCommand& pass, std::vector<std::vector<float>>& logits);
  // One rank's share of a command: kAdd / kAddOnPages do not use `world`; kPass is collective. `logits`
  // (world rank 0's) gets the pass's last-position logits.
  void apply_add(engine::InProcessRank& me, const RankCommand& add);
  void apply_pass(engine::InProcessRank& me, int rank, comm::Communicator& world, const RankCommand& pass,
                  std::vector<std::vector<float>>* logits);
  // Ranks as processes: this rank's add, then every rank's outcome; undone everywhere when one failed.
  void add_collectively(const RankCommand& add);

  EngineExecutorOptions options_;
  model::Qwen3MoeConfig config_;
  std::unique_ptr<engine::ParallelLayout> layout_;
  eplb::Placement initial_placement_;
  std::unique_ptr<RoutingCountRecorder> recorder_;
  std::vector<engine::InProcessRank> ranks_;  // [world size]; rank r's touched only by its thread (processes: [1])
  std::unique_ptr<engine::RankThreads> threads_;  // null with ranks as processes
  std::map<SequenceId, Capacity> live_;       // caller side: validation before anything reaches the ranks
  std::vector<SequenceId> pending_releases_;
  uint64_t num_passes_ = 0;
};

}  // namespace fulcrum::server
