#include "engine/rank_eplb.hpp"

#include <cstdio>

#include "eplb/error.hpp"
#include "eplb_runtime/slot_copy_executor.hpp"

namespace fulcrum::engine {

void validate_eplb_settings(const EplbSettings& settings) {
  FULCRUM_CHECK(settings.recorder_buffer_size > 0, "--expert-distribution-recorder-buffer-size must be positive, got {}",
                settings.recorder_buffer_size);
  FULCRUM_CHECK(settings.rebalance_num_iterations > 0, "--eplb-rebalance-num-iterations must be positive, got {}",
                settings.rebalance_num_iterations);
  FULCRUM_CHECK(settings.rebalance_layers_per_chunk >= 0, "--eplb-rebalance-layers-per-chunk must be >= 0, got {}",
                settings.rebalance_layers_per_chunk);
}

std::string why_eplb_cannot_run(const ParallelLayout& layout, const model::Qwen3MoeConfig& config) {
  if (config.moe_layer_indices().empty()) return "the model has no MoE layer";
  if (layout.ep() == 1) return "a single EP rank (--ep 1) has nothing to balance across";
  return "";
}

RankEplb::RankEplb(RankEngine& engine, comm::Communicator& world, model::Backend& backend,
                   const eplb::Placement& initial, const EplbSettings& settings)
    : engine_(engine), world_(world), initial_(initial) {
  validate_eplb_settings(settings);
  const model::Qwen3MoeConfig& config = engine.model().config();
  const ParallelLayout& layout = engine.layout();
  const RankCoords& coords = engine.coords();
  initial_.topology = {layout.num_physical_experts(), layout.ep(), 1};
  const std::vector<model::ExpertSlotView> views = engine.model().expert_slot_views();
  std::vector<int> owned;
  for (const auto& view : views) owned.push_back(view.moe_layer_idx);
  // (A stage without MoE layers passes none, "all", and is never called: the hook runs per owned MoE layer.)
  eplb_runtime::RecorderOptions recorder_options{settings.recorder_mode, settings.recorder_buffer_size,
                                                 initial_.num_layers, initial_.num_logical_experts, owned,
                                                 config.num_experts_per_tok};
  recorder_ = std::make_unique<eplb_runtime::ExpertRecorder>(std::move(recorder_options));
  engine.set_routing_hook([recorder = recorder_.get()](const RoutingRecord& record) {
    recorder->record(record.moe_layer_idx, record.expert_ids);
  });
  if (!settings.enabled) return;

  FULCRUM_CHECK(why_eplb_cannot_run(layout, config).empty(), "EPLB cannot run: {}", why_eplb_cannot_run(layout, config));
  ep_comm_ = world.split(coords.pp_rank * layout.moe_tp_size() + coords.moe_tp_rank, coords.ep_rank);
  eplb_runtime::ManagerOptions manager_options;
  manager_options.rebalance_num_iterations = settings.rebalance_num_iterations;
  manager_options.rebalance_layers_per_chunk = settings.rebalance_layers_per_chunk;
  manager_options.skip_balancedness = settings.skip_balancedness;
  // Reports count whole slots (every slice), fp32 as the CPU backend holds them.
  manager_options.bytes_per_slot = int64_t{3} * config.moe_intermediate_size * config.hidden_size * int64_t{sizeof(float)};
  if (world.rank() != 0) {
    manager_options.log = [](const std::string&) {};
  } else if (settings.log) {
    manager_options.log = settings.log;
  }
  manager_ = std::make_unique<eplb_runtime::EplbManager>(initial_, std::move(manager_options));
  executor_ = std::make_unique<eplb_runtime::BackendSlotCopyExecutor>(backend, *ep_comm_);
  runtime_ = std::make_unique<eplb_runtime::EplbRuntime>(
      *recorder_, *manager_, views, *executor_, world, *ep_comm_, eplb_runtime::MigrationOptions{1, 0},
      [&engine](int moe_layer_idx, std::span<const int32_t> layer_map) {
        engine.commit_layer_placement(moe_layer_idx, layer_map);
      });
}

RankEplb::~RankEplb() = default;

void RankEplb::after_forward_pass() {
  if (runtime_ != nullptr) {
    runtime_->after_forward_pass();  // closes the recorder's pass too
  } else {
    recorder_->end_pass();
  }
}

eplb::LoadMatrix RankEplb::merged_window_loads() { return eplb_runtime::all_reduce_window_loads(*recorder_, world_); }

void RankEplb::dump(const std::string& path) {
  recorder_->merge_across_ranks(world_);
  if (world_.rank() == 0) recorder_->dump(path);
  world_.barrier();  // nobody reads the file before it is there
}

std::vector<eplb_runtime::RebalanceReport> RankEplb::rebalances() const {
  return manager_ != nullptr ? manager_->history() : std::vector<eplb_runtime::RebalanceReport>{};
}

const eplb::Placement& RankEplb::live_placement() const {
  return runtime_ != nullptr ? runtime_->live_placement() : initial_;
}

eplb_runtime::MigrationStats RankEplb::migration_totals() const {
  return runtime_ != nullptr ? runtime_->migration_totals() : eplb_runtime::MigrationStats{};
}

}  // namespace fulcrum::engine
