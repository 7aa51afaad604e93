#include "gpu/gpu_rank_eplb.hpp"

#include <algorithm>
#include <chrono>
#include <span>
#include <utility>

#include <fmt/format.h>

#include "eplb/error.hpp"

namespace fulcrum::gpu {
namespace {

eplb_runtime::ManagerOptions with_slot_bytes(eplb_runtime::ManagerOptions options, const GpuEngine& engine) {
  const backend::GpuSlotPool* pool = engine.weights().slot_pool();
  FULCRUM_CHECK(pool != nullptr, "EPLB on GPU ranks: the model has no MoE layer");
  options.bytes_per_slot = pool->slot_bytes();
  return options;
}

// The all-gather of one int64 array per rank, as [rank][n].
std::vector<int64_t> gather_all(comm::DeviceExchange& exchange, const std::vector<int64_t>& mine) {
  std::vector<int64_t> all(mine.size() * static_cast<size_t>(exchange.size()));
  exchange.all_gather(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)));
  return all;
}

}  // namespace

GpuRankEplb::GpuRankEplb(GpuEngine& engine, comm::DeviceExchange& exchange, eplb_runtime::ManagerOptions options)
    : engine_(engine), exchange_(exchange), manager_(engine.placement(), with_slot_bytes(std::move(options), engine)) {
  FULCRUM_CHECK(engine.placement().topology.num_gpus == exchange.size() && exchange.size() > 1,
                "EPLB on GPU ranks: a placement over {} GPUs for {} ranks (EPLB needs more than one)",
                engine.placement().topology.num_gpus, exchange.size());
  baseline_ = engine_.expert_counts();
}

eplb::LoadMatrix GpuRankEplb::merged_window_loads() {
  const std::vector<int64_t> now = engine_.expert_counts();  // the one host read of the window
  std::vector<int64_t> window(now.size());
  for (size_t i = 0; i < now.size(); ++i) window[i] = now[i] - baseline_[i];
  baseline_ = now;
  const std::vector<int64_t> all = gather_all(exchange_, window);
  const eplb::Placement& placement = engine_.placement();
  eplb::LoadMatrix loads(placement.num_layers, placement.num_logical_experts);
  FULCRUM_CHECK(window.size() == loads.values.size(), "EPLB on GPU ranks: {} counts for {} layers x {} experts",
                window.size(), loads.num_layers, loads.num_logical_experts);
  for (size_t r = 0; r < static_cast<size_t>(exchange_.size()); ++r) {
    for (size_t i = 0; i < window.size(); ++i) loads.values[i] += static_cast<double>(all[r * window.size() + i]);
  }
  return loads;
}

void GpuRankEplb::check_same_placement(const eplb::Placement& placement) {
  const std::vector<int64_t> mine(placement.physical_to_logical_map.begin(), placement.physical_to_logical_map.end());
  const std::vector<int64_t> all = gather_all(exchange_, mine);
  for (int r = 0; r < exchange_.size(); ++r) {
    FULCRUM_CHECK(std::equal(mine.begin(), mine.end(), all.begin() + static_cast<ptrdiff_t>(r * mine.size())),
                  "EPLB on GPU ranks: rank {} planned another placement than rank {}", r, exchange_.rank());
  }
}

std::optional<eplb_runtime::RebalanceReport> GpuRankEplb::after_step() {
  if (!manager_.on_forward_pass()) return std::nullopt;
  last_window_ = merged_window_loads();
  eplb_runtime::RebalanceReport report = manager_.rebalance(last_window_);
  check_same_placement(manager_.placement());
  if (report.skipped) return report;
  const auto start = std::chrono::steady_clock::now();
  const int64_t received = engine_.apply_placement(manager_.placement());
  slots_moved_ += received;
  const double ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The pause the migration puts between two steps (every rank waits for the slowest in the exchange).
  if (manager_.options().log) {
    manager_.options().log(fmt::format("rebalance {}: slots migrated between two steps in {:.1f} ms ({} received by rank {})",
                                       report.rebalance_idx, ms, received, exchange_.rank()));
  }
  return report;
}

}  // namespace fulcrum::gpu
