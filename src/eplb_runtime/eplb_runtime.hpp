#pragma once
// The EPLB loop of one rank, between forward passes: close the recorder's pass, rebalance when the
// manager says so (loads merged over `load_comm`, same placement on every rank), and advance a running
// migration by one step (over `ep_comm`), so forward passes keep running while weights move.
//
// The engine calls after_forward_pass() on every rank after every forward pass (collective) and
// dispatches with live_placement(): rows of layers not yet switched are the old placement, switched
// rows the new one, and the slots match it (the views' physical_to_logical too).
// A view's physical_to_logical is only this rank's part of the layer; the engine keeps the whole layer
// map (view.layer_map, what replica choice reads) and switches it in `on_layer_switched`, called for
// every layer right after its slots are complete (also inside a forced finish).
// A rebalance that falls due while a migration is still running first finishes that migration (logged),
// so plans always start from what the slots hold. The recorder's window is kept across rebalances
// (loads are per logical expert, independent of the placement).
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "comm/communicator.hpp"
#include "eplb_runtime/eplb_manager.hpp"
#include "eplb_runtime/expert_recorder.hpp"
#include "eplb_runtime/slot_copy_executor.hpp"
#include "eplb_runtime/slot_migration.hpp"
#include "model/qwen3_moe.hpp"

namespace fulcrum::eplb_runtime {

struct PassOutcome {
  std::optional<RebalanceReport> rebalance;  // present when a rebalance ran after this pass
  std::vector<int> switched_layers;          // MoE layers switched to the new placement after this pass
};

// Called with a MoE layer and its new whole-layer map [P] once this rank's slots of the layer hold it.
using LayerSwitchedFn = std::function<void(int moe_layer_idx, std::span<const int32_t> layer_map)>;

class EplbRuntime {
 public:
  // `views`: this rank's views (its stage's MoE layers); they must hold manager.placement() (checked).
  // load_comm: the ranks whose recorders together saw every token; ep_comm: this stage's EP ranks.
  EplbRuntime(ExpertRecorder& recorder, EplbManager& manager, std::vector<model::ExpertSlotView> views,
              SlotCopyExecutor& executor, comm::Communicator& load_comm, comm::Communicator& ep_comm,
              MigrationOptions migration_options = {}, LayerSwitchedFn on_layer_switched = {});

  PassOutcome after_forward_pass();

  bool migrating() const { return migration_ != nullptr; }
  const eplb::Placement& live_placement() const { return live_; }
  // Totals over every migration so far.
  const MigrationStats& migration_totals() const { return totals_; }

 private:
  std::vector<int> step_migration();
  void finish_migration();

  ExpertRecorder& recorder_;
  EplbManager& manager_;
  std::vector<model::ExpertSlotView> views_;
  SlotCopyExecutor& executor_;
  comm::Communicator& load_comm_;
  comm::Communicator& ep_comm_;
  MigrationOptions migration_options_;
  eplb::Placement live_;
  std::unique_ptr<PlacementMigration> migration_;
  MigrationStats totals_;
  LayerSwitchedFn on_layer_switched_;
};

}  // namespace fulcrum::eplb_runtime
