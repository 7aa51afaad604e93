#pragma once
// Live EPLB on the GPU engine's expert-parallel ranks (`--device cuda --ep W --enable-eplb`, GpuEngineOptions::ep):
// every rank calls after_step() after each of its lockstep steps. Every rebalance_num_iterations steps the ranks read
// their device histograms once (the window: the steps since the previous rebalance; no host synchronization on the
// other steps), sum them through the exchange's all-gather, and the manager plans on the sums, so every rank
// derives the same placement (checked through the exchange); GpuEngine::apply_placement then moves the slots that
// changed, rank to rank through the exchange, between two steps. No CUDA header here.
#include <cstdint>
#include <optional>
#include <vector>

#include "comm/device_exchange.hpp"
#include "eplb_runtime/eplb_manager.hpp"
#include "gpu/gpu_engine.hpp"

namespace fulcrum::gpu {

class GpuRankEplb {
 public:
  // The engine must run as an EP rank over `exchange` and outlive this object; options.bytes_per_slot is set here
  // (the slot pool's). Collective construction is not needed: every rank builds one with the same options.
  GpuRankEplb(GpuEngine& engine, comm::DeviceExchange& exchange, eplb_runtime::ManagerOptions options);

  // Collective on every rebalance_num_iterations-th call: the rebalance's report (the same on every rank), else
  // nothing. A rebalance that changed layers has migrated them when this returns.
  std::optional<eplb_runtime::RebalanceReport> after_step();

  const std::vector<eplb_runtime::RebalanceReport>& rebalances() const { return manager_.history(); }
  const eplb::Placement& placement() const { return engine_.placement(); }  // what the slots hold
  // Slots of this rank that received another expert, over every rebalance.
  int64_t slots_moved() const { return slots_moved_; }
  // The loads the last rebalance planned on (summed over the ranks); empty before the first.
  const eplb::LoadMatrix& last_window() const { return last_window_; }

 private:
  // The window's loads [moe layers][experts] summed over the ranks (collective).
  eplb::LoadMatrix merged_window_loads();
  // Throws a one-line error when the ranks' placements differ (collective).
  void check_same_placement(const eplb::Placement& placement);

  GpuEngine& engine_;
  comm::DeviceExchange& exchange_;
  eplb_runtime::EplbManager manager_;
  std::vector<int64_t> baseline_;  // the engine's counts at the last window's start
  eplb::LoadMatrix last_window_;
  int64_t slots_moved_ = 0;
};

}  // namespace fulcrum::gpu
