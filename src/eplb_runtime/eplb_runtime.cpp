#include "eplb_runtime/eplb_runtime.hpp"

#include <algorithm>

namespace fulcrum::eplb_runtime {

EplbRuntime::EplbRuntime(ExpertRecorder& recorder, EplbManager& manager, std::vector<model::ExpertSlotView> views,
                         SlotCopyExecutor& executor, comm::Communicator& load_comm, comm::Communicator& ep_comm,
                         MigrationOptions migration_options, LayerSwitchedFn on_layer_switched)
    : recorder_(recorder), manager_(manager), views_(std::move(views)), executor_(executor), load_comm_(load_comm),
      ep_comm_(ep_comm), migration_options_(migration_options), live_(manager.placement()),
      on_layer_switched_(std::move(on_layer_switched)) {
  const auto& recorder_options = recorder.options();
  FULCRUM_CHECK(recorder_options.num_moe_layers == live_.num_layers &&
                    recorder_options.num_logical_experts == live_.num_logical_experts,
                "EPLB: the recorder counts {} MoE layers x {} experts, the placement has {} x {}",
                recorder_options.num_moe_layers, recorder_options.num_logical_experts, live_.num_layers,
                live_.num_logical_experts);
  FULCRUM_CHECK(live_.topology.num_gpus == ep_comm.size(), "EPLB: the placement spans {} EP ranks, the EP group has {}",
                live_.topology.num_gpus, ep_comm.size());
  // A no-op migration checks that the views hold the placement (slot counts and maps).
  PlacementMigration check(live_, live_, views_, executor_, ep_comm_, migration_options_);
}

std::vector<int> EplbRuntime::step_migration() {
  const std::vector<int> switched = migration_->step();
  for (const int layer_idx : switched) {
    const auto row = migration_->live_placement().layer(layer_idx);
    std::copy(row.begin(), row.end(), live_.layer(layer_idx).begin());
    if (on_layer_switched_) on_layer_switched_(layer_idx, row);
  }
  if (migration_->done()) {
    const MigrationStats& s = migration_->stats();
    totals_.num_layers_switched += s.num_layers_switched;
    totals_.num_steps += s.num_steps;
    totals_.num_local_copies += s.num_local_copies;
    totals_.num_received += s.num_received;
    totals_.num_sent += s.num_sent;
    totals_.bytes_received += s.bytes_received;
    totals_.bytes_sent += s.bytes_sent;
    totals_.peak_staging_bytes = std::max(totals_.peak_staging_bytes, s.peak_staging_bytes);
    migration_.reset();
    // Owned layers now hold the target; rows of other stages' layers are not used here: set them too.
    live_ = manager_.placement();
  }
  return switched;
}

void EplbRuntime::finish_migration() {
  manager_.options().log("rebalance due while a migration is still running: finishing it first");
  while (migration_ != nullptr) step_migration();
}

PassOutcome EplbRuntime::after_forward_pass() {
  PassOutcome outcome;
  recorder_.end_pass();
  if (manager_.on_forward_pass()) {
    if (migration_ != nullptr) finish_migration();
    outcome.rebalance = rebalance_across_ranks(manager_, recorder_, load_comm_);
    if (!outcome.rebalance->skipped) {
      migration_ = std::make_unique<PlacementMigration>(live_, manager_.placement(), views_, executor_, ep_comm_,
                                                        migration_options_);
      if (migration_->done()) {  // no layer this stage owns changed
        migration_.reset();
        live_ = manager_.placement();
      }
    }
  }
  if (migration_ != nullptr) outcome.switched_layers = step_migration();
  return outcome;
}

}  // namespace fulcrum::eplb_runtime
