#pragma once
// EPLB manager: decides when to rebalance, which MoE layers, and to which placement.
//
// Cadence: on_forward_pass() counts passes; every `rebalance_num_iterations` passes it says a rebalance
// is due (the same pass on every rank). A rebalance covers one chunk of `rebalance_layers_per_chunk`
// MoE layers (0: all), successive rebalances the successive chunks, wrapping around.
// Per layer of the chunk: when the current placement's balancedness on the window loads is already
// >= skip_balancedness, the layer is kept; otherwise it is replanned (the planner sees the current map)
// and the new map is adopted only when it is strictly better on the same loads. When no layer changes,
// the rebalance is skipped and logged.
// Default threshold 0.95: about what a fresh DeepSeek-style plan reaches on real Qwen3 loads at EP32
// (0.94-0.985), so a layer that still does that well is not worth moving weights for, and a layer that
// drifted below it is.
// Determinism: the result depends only on (window loads, current placement, options); feed every rank
// the same merged loads (all_reduce_window_loads) and every rank derives the same placement.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "eplb/loads.hpp"
#include "eplb/placement.hpp"
#include "eplb/planner.hpp"
#include "eplb_runtime/expert_recorder.hpp"

namespace fulcrum::eplb_runtime {

// "fulcrum" when make_planner knows it, else "deepseek".
std::string default_planner_name();

struct ManagerOptions {
  int rebalance_num_iterations = 1000;  // --eplb-rebalance-num-iterations
  int rebalance_layers_per_chunk = 0;   // --eplb-rebalance-layers-per-chunk; 0: every MoE layer at once
  double skip_balancedness = 0.95;      // keep layers at or above this balancedness
  std::string planner_name;             // empty: default_planner_name()
  int num_groups = 1;                   // expert groups for the planner (Qwen3: 1)
  int64_t bytes_per_slot = 0;           // weights of one slot, for the bytes in reports
  std::function<void(const std::string&)> log;  // one line per rebalance; empty: stderr
};

struct RebalanceReport {
  int rebalance_idx = 0;
  int64_t pass_idx = 0;                // forward passes counted when it ran
  std::vector<int> chunk_layers;       // MoE layers considered
  std::vector<int> changed_layers;     // MoE layers whose map changed
  bool skipped = false;                // no layer changed
  double balancedness_before = 1.0;    // mean over the chunk's layers, on the window loads
  double balancedness_after = 1.0;
  int64_t num_slots_moved = 0;         // slots whose logical expert changed
  int64_t num_network_transfers = 0;   // of those, received from another rank
  int64_t num_bytes_moved = 0;         // num_network_transfers * bytes_per_slot
  int64_t num_bytes_local = 0;         // local copies * bytes_per_slot
  std::string message;                 // what was logged
};

class EplbManager {
 public:
  EplbManager(eplb::Placement initial, ManagerOptions options);

  const ManagerOptions& options() const { return options_; }
  // The placement the manager last decided on (the target while a migration is running).
  const eplb::Placement& placement() const { return placement_; }
  // MoE layers the next rebalance will cover.
  std::vector<int> next_chunk() const;
  const std::vector<RebalanceReport>& history() const { return history_; }
  int64_t num_passes() const { return num_passes_; }

  // Counts one forward pass; true when a rebalance is due after it.
  bool on_forward_pass();
  // Plans the next chunk on `window_loads` [num_moe_layers][num_logical_experts], updates placement(),
  // advances to the next chunk, logs and returns the report.
  RebalanceReport rebalance(const eplb::LoadMatrix& window_loads);

 private:
  eplb::Placement placement_;
  ManagerOptions options_;
  std::unique_ptr<eplb::Planner> planner_;
  int next_chunk_start_ = 0;
  int64_t num_passes_ = 0;
  std::vector<RebalanceReport> history_;
};

// Collective over `comm` (the ranks whose recorders together saw every token): merges the window
// loads exactly, rebalances, and checks that every rank derived the same placement (throws otherwise).
RebalanceReport rebalance_across_ranks(EplbManager& manager, const ExpertRecorder& recorder, comm::Communicator& comm);

// Collective: throws fulcrum::Error naming the ranks when their placements differ.
void check_same_placement(const eplb::Placement& placement, comm::Communicator& comm);

}  // namespace fulcrum::eplb_runtime
