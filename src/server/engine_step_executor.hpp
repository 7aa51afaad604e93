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
//
// Elastic EP (options.elastic_mesh set: --enable-elastic-ep; elastic_world.hpp for the layout and the
// protocol): a call whose world fails is not an ExecutorFailure. Rank 0 calls the roll, the survivors form
// the next epoch's world and each rebuilds its rank of the smaller layout (a placement re-planned on their
// recorded loads; expert slots from its own or a survivor's copy, engine/rebuild_slots.hpp, from the checkpoint
// only where every replica was lost; the other weights from the checkpoint), the scheduler's KV groups whose
// rank was lost are re-homed on survivors (its group count never changes; a rank hosting several keeps each one's
// pages at its own offset of its pool, page_offset), every live sequence is dropped and the call throws
// WorldReformed: the scheduler drops its prefix cache and runs every live request again from its tokens so
// far. Greedy outputs do not change: a sequence's logits depend only on its own tokens, whatever the layout.
// A rank that rejoins (PeerMesh::take_rejoined) is brought in the same way at rank 0's next call: the roll
// over the members and the newcomer, the world of them all (its KV group home again, the launch layout's
// slots per rank), WorldReformed. The newcomer's process builds no rank of its own until then (a joined-late
// mesh): serve_as_worker answers that roll call first; holding no expert, it receives its slots from the others.
#include <chrono>
#include <functional>
#include <optional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/parallel_generate.hpp"
#include "engine/rebuild_slots.hpp"
#include "engine/rank_threads.hpp"
#include "comm/peer_mesh.hpp"
#include "server/elastic_world.hpp"
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
  // Set (with process_world over it): elastic EP, every rank surviving the loss of ranks other than 0.
  std::shared_ptr<comm::PeerMesh> elastic_mesh;
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
  int num_kv_groups() const override { return num_kv_groups_; }
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
    int kv_group = 0;  // the scheduler's (elastic: its host may change)
  };
  // Rank 0, ranks as processes: runs `attempt` on the world; with elastic EP, after a failure, forms the new
  // world (again while forming it fails) and throws WorldReformed (without: ExecutorFailure).
  template <class Attempt>
  void on_world(Attempt&& attempt);
  // Elastic, every rank: the new world's communicator and this rank of the smaller layout.
  void rebuild(const NewWorld& world);
  // Elastic, rank 0: the roll call and the rebuild.
  void reform_world();
  // Elastic, a worker: answers roll calls until a rebuild completes (throws when rank 0 is gone).
  void join_next_world();
  // Elastic, rank 0, before the rebuild: the line counting the logical experts whose every replica was on a
  // rank not among `answered` ("" without MoE layers or without a lost rank).
  std::string describe_lost_last_replicas(const std::vector<int>& answered, const std::vector<int>& lost) const;
  // The attention-DP group of the current world that holds the scheduler's KV group `kv_group`.
  int physical_group(int kv_group) const;
  // Elastic: where the scheduler's KV group `kv_group` has its pages in its host's pool (which holds
  // kv_pages for each group it hosts, in group order).
  int32_t page_offset(int kv_group) const;
  void elastic_log(const std::string& line) const;
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
  int num_kv_groups_ = 1;  // the scheduler's, fixed at start
  // Elastic EP: the current world (null before the first recovery: options_.process_world), its mesh ranks,
  // the mesh rank hosting each of the scheduler's KV groups, and the recovery in progress.
  comm::Communicator* world_ = nullptr;
  std::unique_ptr<comm::Communicator> elastic_world_;
  std::vector<int> members_;
  std::vector<int> group_hosts_;
  std::vector<int> newcomers_;  // rejoined ranks the next roll call brings in
  // The expert slots of the last rank this process ran, until a rebuild completes (kept across failed ones).
  std::unique_ptr<engine::HeldExperts> held_;
  std::optional<eplb::LoadMatrix> held_loads_;  // this rank's recorded loads, kept with held_ across a failed rebuild
  int launch_slots_per_rank_ = 0;
  bool needs_reform_ = false;
  std::optional<std::chrono::steady_clock::time_point> fault_at_;  // detected, not yet recovered
  std::optional<std::chrono::steady_clock::time_point> rejoin_at_;  // a newcomer taken, no step completed since
};

}  // namespace fulcrum::server
