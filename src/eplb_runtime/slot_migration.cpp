#include "eplb_runtime/slot_migration.hpp"

#include <algorithm>

namespace fulcrum::eplb_runtime {

PlacementMigration::PlacementMigration(const eplb::Placement& from, const eplb::Placement& to,
                                       std::span<const model::ExpertSlotView> views, SlotCopyExecutor& executor,
                                       comm::Communicator& ep_comm, MigrationOptions options)
    : live_(from), to_(to), executor_(executor), ep_comm_(ep_comm), options_(options) {
  FULCRUM_CHECK(options_.layers_per_step > 0, "slot migration: layers_per_step must be positive, got {}",
                options_.layers_per_step);
  FULCRUM_CHECK(options_.max_bytes_per_step >= 0, "slot migration: max_bytes_per_step must be >= 0, got {}",
                options_.max_bytes_per_step);
  from.validate();
  to.validate();
  const eplb::Topology& topo = from.topology;
  FULCRUM_CHECK(topo.num_gpus == ep_comm.size(), "slot migration: the placement has {} EP ranks, the communicator {}",
                topo.num_gpus, ep_comm.size());
  const eplb::MigrationPlan plan = eplb::plan_migration(from, to);  // checks that the shapes match
  transfers_by_layer_.resize(static_cast<size_t>(from.num_layers));
  for (const auto& t : plan.transfers) transfers_by_layer_[static_cast<size_t>(t.layer_idx)].push_back(t);

  const int rank = ep_comm.rank();
  const int slots_per_rank = topo.slots_per_gpu();
  views_by_layer_.resize(static_cast<size_t>(from.num_layers));
  for (const auto& view : views) {
    FULCRUM_CHECK(view.moe_layer_idx >= 0 && view.moe_layer_idx < from.num_layers,
                  "slot migration: view of MoE layer {} outside the placement's {} layers", view.moe_layer_idx,
                  from.num_layers);
    auto& slot = views_by_layer_[static_cast<size_t>(view.moe_layer_idx)];
    FULCRUM_CHECK(slot.num_slots == 0, "slot migration: two views of MoE layer {}", view.moe_layer_idx);
    FULCRUM_CHECK(view.num_slots == slots_per_rank && static_cast<int>(view.physical_to_logical.size()) == slots_per_rank &&
                      view.gate_up.rank() == 3 && view.down.rank() == 3 && view.gate_up.dim(0) == slots_per_rank &&
                      view.down.dim(0) == slots_per_rank,
                  "slot migration: MoE layer {}: the view holds {} slots, EP rank {} of {} should hold {} (P = {})",
                  view.moe_layer_idx, view.num_slots, rank, topo.num_gpus, slots_per_rank, topo.num_physical_experts);
    // An engine view knows where its slots sit; a bare view (slot_begin 0, no layer size) is taken at face value.
    FULCRUM_CHECK(view.num_physical_experts == 0 || (view.slot_begin == rank * slots_per_rank &&
                                                      view.num_physical_experts == topo.num_physical_experts),
                  "slot migration: MoE layer {}: the view holds slots [{}, +{}) of {}, EP rank {} should hold [{}, +{}) of {}",
                  view.moe_layer_idx, view.slot_begin, view.num_slots, view.num_physical_experts, rank,
                  rank * slots_per_rank, slots_per_rank, topo.num_physical_experts);
    const auto old_map = from.layer(view.moe_layer_idx);
    for (int local = 0; local < slots_per_rank; ++local) {
      const int global = rank * slots_per_rank + local;
      FULCRUM_CHECK(view.physical_to_logical[local] == old_map[global],
                    "slot migration: MoE layer {} slot {} holds logical expert {}, the old placement says {}",
                    view.moe_layer_idx, global, view.physical_to_logical[local], old_map[global]);
    }
    const int64_t bytes = slot_bytes(view);
    FULCRUM_CHECK(slot_bytes_ == 0 || slot_bytes_ == bytes, "slot migration: slot sizes differ between layers");
    slot_bytes_ = bytes;
    slot = view;
  }
  for (int layer_idx = 0; layer_idx < from.num_layers; ++layer_idx) {
    if (views_by_layer_[static_cast<size_t>(layer_idx)].num_slots > 0 &&
        !transfers_by_layer_[static_cast<size_t>(layer_idx)].empty()) {
      pending_layers_.push_back(layer_idx);
    }
  }
}

std::vector<int> PlacementMigration::step() {
  std::vector<int> switched;
  int64_t step_bytes = 0;
  while (!done() && static_cast<int>(switched.size()) < options_.layers_per_step) {
    const int layer_idx = pending_layers_[next_layer_pos_];
    const int64_t layer_bytes =
        static_cast<int64_t>(transfers_by_layer_[static_cast<size_t>(layer_idx)].size()) * slot_bytes_;
    if (!switched.empty() && options_.max_bytes_per_step > 0 && step_bytes + layer_bytes > options_.max_bytes_per_step) {
      break;
    }
    migrate_layer(layer_idx);
    step_bytes += layer_bytes;
    switched.push_back(layer_idx);
    ++next_layer_pos_;
  }
  if (!switched.empty()) ++stats_.num_steps;
  return switched;
}

void PlacementMigration::migrate_layer(int moe_layer_idx) {
  const model::ExpertSlotView& view = views_by_layer_[static_cast<size_t>(moe_layer_idx)];
  const auto& transfers = transfers_by_layer_[static_cast<size_t>(moe_layer_idx)];
  const eplb::Topology& topo = live_.topology;
  const int rank = ep_comm_.rank();
  const int first_slot = rank * topo.slots_per_gpu();

  // Staging entry of each incoming transfer, in plan order (local copies come first in the plan).
  std::vector<int> staging_of(transfers.size(), -1);
  int num_incoming = 0;
  for (size_t i = 0; i < transfers.size(); ++i) {
    if (topo.gpu_of_slot(transfers[i].dst_slot) == rank) staging_of[i] = num_incoming++;
  }
  executor_.begin_layer(view, num_incoming);
  for (size_t i = 0; i < transfers.size(); ++i) {
    const auto& t = transfers[i];
    if (staging_of[i] >= 0 && topo.gpu_of_slot(t.src_slot) == rank) {
      executor_.copy_local(view, t.src_slot - first_slot, staging_of[i]);
      ++stats_.num_local_copies;
    }
  }
  for (const auto& t : transfers) {
    const int dst_rank = topo.gpu_of_slot(t.dst_slot);
    if (topo.gpu_of_slot(t.src_slot) == rank && dst_rank != rank) {
      executor_.send(view, t.src_slot - first_slot, dst_rank);
      ++stats_.num_sent;
      stats_.bytes_sent += slot_bytes_;
    }
  }
  for (size_t i = 0; i < transfers.size(); ++i) {
    const int src_rank = topo.gpu_of_slot(transfers[i].src_slot);
    if (staging_of[i] >= 0 && src_rank != rank) {
      executor_.recv(view, staging_of[i], src_rank);
      ++stats_.num_received;
      stats_.bytes_received += slot_bytes_;
    }
  }
  executor_.wait();
  // Commit: weights and map of every changed slot together, then the layer's row of the live placement.
  for (size_t i = 0; i < transfers.size(); ++i) {
    if (staging_of[i] < 0) continue;
    const int local_slot = transfers[i].dst_slot - first_slot;
    executor_.commit_slot(view, staging_of[i], local_slot);
    view.physical_to_logical[local_slot] = transfers[i].expert_idx;
  }
  executor_.end_layer();
  const auto new_map = to_.layer(moe_layer_idx);
  std::copy(new_map.begin(), new_map.end(), live_.layer(moe_layer_idx).begin());
  ++stats_.num_layers_switched;
  stats_.peak_staging_bytes = executor_.peak_staging_bytes();
}

}  // namespace fulcrum::eplb_runtime
