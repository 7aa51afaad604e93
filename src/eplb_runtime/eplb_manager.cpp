#include "eplb_runtime/eplb_manager.hpp"

#include <algorithm>
#include <cstdio>

#include <fmt/ranges.h>

#include "eplb/metrics.hpp"
#include "eplb/migration_plan.hpp"
#include "eplb_runtime/rank_collectives.hpp"

namespace fulcrum::eplb_runtime {

std::string default_planner_name() {
  const auto names = eplb::planner_names();
  return std::find(names.begin(), names.end(), "fulcrum") != names.end() ? "fulcrum" : "deepseek";
}

EplbManager::EplbManager(eplb::Placement initial, ManagerOptions options)
    : placement_(std::move(initial)), options_(std::move(options)) {
  placement_.validate();
  FULCRUM_CHECK(placement_.num_layers > 0, "EPLB is on but the model has no MoE layer");
  FULCRUM_CHECK(options_.rebalance_num_iterations > 0,
                "EPLB is on but --eplb-rebalance-num-iterations is {}; it must be positive",
                options_.rebalance_num_iterations);
  FULCRUM_CHECK(options_.rebalance_layers_per_chunk >= 0, "--eplb-rebalance-layers-per-chunk must be >= 0, got {}",
                options_.rebalance_layers_per_chunk);
  FULCRUM_CHECK(options_.skip_balancedness >= 0.0 && options_.skip_balancedness <= 1.0,
                "EPLB skip threshold must be in [0, 1], got {}", options_.skip_balancedness);
  FULCRUM_CHECK(options_.bytes_per_slot >= 0, "bytes per slot must be >= 0, got {}", options_.bytes_per_slot);
  if (options_.planner_name.empty()) options_.planner_name = default_planner_name();
  planner_ = eplb::make_planner(options_.planner_name);
  if (!options_.log) options_.log = [](const std::string& line) { std::fprintf(stderr, "[eplb] %s\n", line.c_str()); };
  if (placement_.topology.num_gpus == 1) {
    options_.log("warning: EPLB on a single EP rank does nothing (one GPU is always balanced); every rebalance "
                 "will be skipped");
  }
}

bool EplbManager::on_forward_pass() {
  ++num_passes_;
  return num_passes_ % options_.rebalance_num_iterations == 0;
}

std::vector<int> EplbManager::next_chunk() const {
  const int num_layers = placement_.num_layers;
  const int chunk = options_.rebalance_layers_per_chunk == 0 ? num_layers
                                                             : std::min(options_.rebalance_layers_per_chunk, num_layers);
  std::vector<int> layers;
  for (int i = 0; i < chunk; ++i) layers.push_back((next_chunk_start_ + i) % num_layers);
  return layers;
}

RebalanceReport EplbManager::rebalance(const eplb::LoadMatrix& window_loads) {
  FULCRUM_CHECK(window_loads.num_layers == placement_.num_layers &&
                    window_loads.num_logical_experts == placement_.num_logical_experts,
                "EPLB rebalance: loads are {} x {} but the placement is {} MoE layers x {} experts",
                window_loads.num_layers, window_loads.num_logical_experts, placement_.num_layers,
                placement_.num_logical_experts);
  RebalanceReport report;
  report.rebalance_idx = static_cast<int>(history_.size());
  report.pass_idx = num_passes_;
  report.chunk_layers = next_chunk();
  const eplb::Topology& topo = placement_.topology;
  const eplb::Placement before = placement_;
  eplb::PlanOptions plan_options{topo, options_.num_groups, &before};
  std::vector<int32_t> candidate(static_cast<size_t>(topo.num_physical_experts));
  double sum_before = 0.0, sum_after = 0.0;
  for (const int layer_idx : report.chunk_layers) {
    const auto load = window_loads.layer(layer_idx);
    const double old_balancedness = eplb::balancedness(eplb::gpu_loads(load, before.layer(layer_idx), topo));
    double new_balancedness = old_balancedness;
    if (old_balancedness < options_.skip_balancedness) {
      planner_->plan_layer(load, plan_options, before.layer(layer_idx), candidate);
      const double planned = eplb::balancedness(eplb::gpu_loads(load, candidate, topo));
      if (planned > old_balancedness) {
        std::copy(candidate.begin(), candidate.end(), placement_.layer(layer_idx).begin());
        new_balancedness = planned;
        report.changed_layers.push_back(layer_idx);
      }
    }
    sum_before += old_balancedness;
    sum_after += new_balancedness;
  }
  placement_.validate();
  const double num_chunk_layers = static_cast<double>(report.chunk_layers.size());
  report.balancedness_before = sum_before / num_chunk_layers;
  report.balancedness_after = sum_after / num_chunk_layers;
  report.skipped = report.changed_layers.empty();
  const eplb::MigrationPlan migration = eplb::plan_migration(before, placement_);
  report.num_slots_moved = migration.num_transfers();
  report.num_network_transfers = migration.num_intra_node + migration.num_inter_node;
  report.num_bytes_moved = report.num_network_transfers * options_.bytes_per_slot;
  report.num_bytes_local = migration.num_local * options_.bytes_per_slot;
  next_chunk_start_ = (next_chunk_start_ + static_cast<int>(report.chunk_layers.size())) % placement_.num_layers;

  const std::string layers = fmt::format("MoE layers {}..{} ({} layers)", report.chunk_layers.front(),
                                         report.chunk_layers.back(), report.chunk_layers.size());
  const bool no_load = std::all_of(window_loads.values.begin(), window_loads.values.end(), [](double v) { return v == 0.0; });
  if (no_load) {
    report.message = fmt::format("rebalance {} at pass {}: skipped, no load recorded in the window (is the recorder on?)",
                                 report.rebalance_idx, report.pass_idx);
  } else if (report.skipped) {
    report.message = fmt::format(
        "rebalance {} at pass {}: skipped, {}: balancedness {:.4f}, no layer below {:.3f} improved by the {} planner",
        report.rebalance_idx, report.pass_idx, layers, report.balancedness_before, options_.skip_balancedness,
        options_.planner_name);
  } else {
    report.message = fmt::format(
        "rebalance {} at pass {}: {}: balancedness {:.4f} -> {:.4f}, {} layers changed, {} slots moved "
        "({} over the network, {} bytes; {} bytes local)",
        report.rebalance_idx, report.pass_idx, layers, report.balancedness_before, report.balancedness_after,
        report.changed_layers.size(), report.num_slots_moved, report.num_network_transfers, report.num_bytes_moved,
        report.num_bytes_local);
  }
  options_.log(report.message);
  history_.push_back(report);
  return report;
}

void check_same_placement(const eplb::Placement& placement, comm::Communicator& comm) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the shape and the map
  auto mix = [&hash](int64_t v) {
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= static_cast<uint64_t>(v >> (8 * byte)) & 0xffu;
      hash *= 1099511628211ull;
    }
  };
  mix(placement.num_layers);
  mix(placement.num_logical_experts);
  mix(placement.num_physical_experts());
  mix(placement.topology.num_gpus);
  for (const int32_t e : placement.physical_to_logical_map) mix(e);
  const int64_t mine = static_cast<int64_t>(hash);
  const std::vector<int64_t> hashes = all_gather_int64(comm, std::span<const int64_t>(&mine, 1));
  for (int r = 1; r < comm.size(); ++r) {
    FULCRUM_CHECK(hashes[static_cast<size_t>(r)] == hashes[0],
                  "EPLB: ranks derived different placements (rank {} differs from rank 0); refusing to migrate", r);
  }
}

RebalanceReport rebalance_across_ranks(EplbManager& manager, const ExpertRecorder& recorder, comm::Communicator& comm) {
  check_same_placement(manager.placement(), comm);
  const eplb::LoadMatrix loads = all_reduce_window_loads(recorder, comm);
  RebalanceReport report = manager.rebalance(loads);
  check_same_placement(manager.placement(), comm);
  return report;
}

}  // namespace fulcrum::eplb_runtime
