#pragma once
// Slot migration: turns the live expert slots of every EP rank from one placement into another, layer
// by layer, between forward passes, through a SlotCopyExecutor.
//
// Contract:
//   * EP rank r (the rank in `ep_comm`) holds global slots [r * P/G, (r+1) * P/G) of every MoE layer its
//     stage owns; its views have num_slots == P/G and physical_to_logical equal to `from` (checked).
//   * Transfers come from eplb::plan_migration: each changed slot is received exactly once; local
//     copies first. Unchanged slots are never written.
//   * A layer is staged completely (at most its incoming slots of this rank, <= one layer's slots) and
//     then committed: slot weights and physical_to_logical are written together, so a layer is always
//     either fully old or fully new. Layers not yet switched keep running on the old placement.
//   * step() is collective over ep_comm: every rank switches the same layers in the same step (the
//     choice depends only on `from`, `to` and the slot size, identical on every rank).
//   * Layers the stage does not own (pipeline parallelism) are not touched; their rows of
//     live_placement() stay as in `from` (another stage migrates them).
#include <cstdint>
#include <span>
#include <vector>

#include "comm/communicator.hpp"
#include "eplb/migration_plan.hpp"
#include "eplb/placement.hpp"
#include "eplb_runtime/slot_copy_executor.hpp"
#include "model/qwen3_moe.hpp"

namespace fulcrum::eplb_runtime {

struct MigrationOptions {
  int layers_per_step = 1;         // at most this many changed layers per step()
  int64_t max_bytes_per_step = 0;  // > 0: also stop before a layer that would pass this many bytes
                                   // (all ranks' transfers, local included); a step always takes one layer
};

struct MigrationStats {
  int64_t num_layers_switched = 0;  // changed layers committed on this rank
  int64_t num_steps = 0;
  int64_t num_local_copies = 0;     // slots this rank filled from its own slots
  int64_t num_received = 0;         // slots this rank received from peers
  int64_t num_sent = 0;             // slots this rank sent to peers
  int64_t bytes_received = 0;
  int64_t bytes_sent = 0;
  int64_t peak_staging_bytes = 0;   // as the executor reports it
};

class PlacementMigration {
 public:
  // `views`: this rank's slot views of the MoE layers its stage owns (any order; copied, they are handles).
  PlacementMigration(const eplb::Placement& from, const eplb::Placement& to, std::span<const model::ExpertSlotView> views,
                     SlotCopyExecutor& executor, comm::Communicator& ep_comm, MigrationOptions options = {});

  bool done() const { return next_layer_pos_ >= pending_layers_.size(); }
  // Collective: switches the next layer(s); returns their MoE layer indices (empty when done).
  std::vector<int> step();

  const eplb::Placement& live_placement() const { return live_; }
  const MigrationStats& stats() const { return stats_; }
  // Changed owned layers in migration order.
  const std::vector<int>& pending_layers() const { return pending_layers_; }

 private:
  void migrate_layer(int moe_layer_idx);

  eplb::Placement live_;
  eplb::Placement to_;
  std::vector<model::ExpertSlotView> views_by_layer_;  // [num_layers]; num_slots == 0 where not owned
  std::vector<std::vector<eplb::SlotTransfer>> transfers_by_layer_;
  std::vector<int> pending_layers_;
  size_t next_layer_pos_ = 0;
  SlotCopyExecutor& executor_;
  comm::Communicator& ep_comm_;
  MigrationOptions options_;
  int64_t slot_bytes_ = 0;
  MigrationStats stats_;
};

}  // namespace fulcrum::eplb_runtime
