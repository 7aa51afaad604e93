#pragma once
// The EPLB loop on one rank of the parallel engine (--enable-eplb): the recorder counts this rank's
// routing through the engine's RoutingHook, the manager rebalances every N forward passes on the loads
// merged over the whole world (so every rank derives the same placement), and the migration moves slots
// layer by layer between forward passes.
//
// Groups: every rank records the tokens it originates in the MoE exchange, so the world's recorders
// together saw every token once (load_comm = world). Slots migrate among the EP ranks of a stage that
// hold the same slice of moe_intermediate_size (ep_comm: same stage, same moe_tp_rank, rank = ep_rank);
// each of the M = tp / ep slices migrates on its own, with the same plan. A layer's whole map (what
// replica choice reads) switches when its slots are complete (RankEngine::commit_layer_placement).
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "engine/parallel_layout.hpp"
#include "engine/rank_engine.hpp"
#include "eplb_runtime/eplb_runtime.hpp"
#include "eplb_runtime/expert_recorder.hpp"

namespace fulcrum::engine {

struct EplbSettings {
  bool enabled = false;  // --enable-eplb: rebalance and migrate (else the recorder only counts, for a dump)
  eplb_runtime::RecorderMode recorder_mode = eplb_runtime::RecorderMode::kStat;  // --expert-distribution-recorder-mode
  int recorder_buffer_size = 1000;        // --expert-distribution-recorder-buffer-size
  int rebalance_num_iterations = 1000;    // --eplb-rebalance-num-iterations
  int rebalance_layers_per_chunk = 0;     // --eplb-rebalance-layers-per-chunk (0: all)
  double skip_balancedness = 0.95;        // layers at or above it are kept (ManagerOptions)
  // World rank 0's lines: one per rebalance (balancedness before -> after, slots and bytes moved, the time
  // of that pass's EPLB step) and one when its migration completes (passes, total time). Empty: stderr.
  std::function<void(const std::string&)> log;
};

// Throws fulcrum::Error (one line) on a bad value; what the CLI checks before starting ranks.
void validate_eplb_settings(const EplbSettings& settings);

// The manager's options of these settings (cadence, chunk size, skip threshold); bytes_per_slot and log are left
// to the caller.
eplb_runtime::ManagerOptions manager_options_of(const EplbSettings& settings);
// Where a rank's EPLB lines go: settings.log, or stderr as "[eplb] LINE" when it is empty; nowhere on a rank that
// does not log (only world rank 0 does).
std::function<void(const std::string&)> eplb_log_of(const EplbSettings& settings, bool this_rank_logs);

// Why EPLB cannot run with this layout and model ("" when it can): a single EP rank, no MoE layer.
std::string why_eplb_cannot_run(const ParallelLayout& layout, const model::Qwen3MoeConfig& config);

class RankEplb {
 public:
  // Collective over `world` (it splits ep_comm). `initial`: the placement the engine was built with
  // (its topology is set to the layout's). The engine, world and backend must outlive this object.
  RankEplb(RankEngine& engine, comm::Communicator& world, model::Backend& backend, const eplb::Placement& initial,
           const EplbSettings& settings);
  ~RankEplb();

  // Collective: closes the recorder's pass; with EPLB, rebalances when due and moves one layer. Returns
  // what happened (the same on every rank).
  eplb_runtime::PassOutcome after_forward_pass();

  // Collective: the recorder's window summed over every rank (exact, the same on every rank).
  eplb::LoadMatrix merged_window_loads();
  // This rank's own window (the tokens it originated), no collective: what survives a lost world.
  eplb::LoadMatrix own_window_loads() const;
  // Collective: merges the recorders over the world, then world rank 0 writes the dump `fulcrum plan` reads.
  void dump(const std::string& path);

  bool enabled() const { return runtime_ != nullptr; }
  // The rebalances so far (every rank has the same).
  std::vector<eplb_runtime::RebalanceReport> rebalances() const;
  // The placement dispatch runs on now (rows of other stages' layers: as planned).
  const eplb::Placement& live_placement() const;
  eplb_runtime::MigrationStats migration_totals() const;

 private:
  std::unique_ptr<eplb_runtime::SlotCopyExecutor> make_executor(model::Backend& backend, comm::Communicator& ep_comm);

  RankEngine& engine_;
  comm::Communicator& world_;
  eplb::Placement initial_;
  std::unique_ptr<eplb_runtime::ExpertRecorder> recorder_;
  std::unique_ptr<comm::Communicator> ep_comm_;
  std::unique_ptr<eplb_runtime::EplbManager> manager_;
  std::unique_ptr<eplb_runtime::SlotCopyExecutor> executor_;
  std::unique_ptr<eplb_runtime::EplbRuntime> runtime_;
  std::function<void(const std::string&)> log_;  // rank 0's; others: none
  std::vector<std::string> manager_lines_;      // what the manager logged during the current pass
  int migrating_rebalance_ = -1;                // rebalance whose migration is running
  int64_t migration_passes_ = 0;
  double migration_seconds_ = 0;
};

}  // namespace fulcrum::engine
