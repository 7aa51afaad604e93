#include "engine/rank_eplb.hpp"

#include <chrono>
#include <cstdio>

#include <fmt/format.h>

#include "eplb/error.hpp"
#include "eplb_runtime/slot_copy_executor.hpp"
#ifdef FULCRUM_WITH_NCCL
#include "gpu/moe/nccl_slot_copy_executor.hpp"
#endif

namespace fulcrum::engine {

void validate_eplb_settings(const EplbSettings& settings) {
  FULCRUM_CHECK(settings.recorder_buffer_size > 0, "--expert-distribution-recorder-buffer-size must be positive, got {}",
                settings.recorder_buffer_size);
  FULCRUM_CHECK(settings.rebalance_num_iterations > 0, "--eplb-rebalance-num-iterations must be positive, got {}",
                settings.rebalance_num_iterations);
  FULCRUM_CHECK(settings.rebalance_layers_per_chunk >= 0, "--eplb-rebalance-layers-per-chunk must be >= 0, got {}",
                settings.rebalance_layers_per_chunk);
}

eplb_runtime::ManagerOptions manager_options_of(const EplbSettings& settings) {
  eplb_runtime::ManagerOptions options;
  options.rebalance_num_iterations = settings.rebalance_num_iterations;
  options.rebalance_layers_per_chunk = settings.rebalance_layers_per_chunk;
  options.skip_balancedness = settings.skip_balancedness;
  return options;
}

std::function<void(const std::string&)> eplb_log_of(const EplbSettings& settings, bool this_rank_logs) {
  if (!this_rank_logs) return [](const std::string&) {};
  if (settings.log) return settings.log;
  return [](const std::string& line) { std::fprintf(stderr, "[eplb] %s\n", line.c_str()); };
}

std::string why_eplb_cannot_run(const ParallelLayout& layout, const model::Qwen3MoeConfig& config) {
  if (config.moe_layer_indices().empty()) return "the model has no MoE layer";
  if (layout.ep() == 1) return "a single EP rank (--ep 1) has nothing to balance across";
  return "";
}

// GPU ranks with an NCCL EP group move slots GPU to GPU; any other rank through the backend and host memory.
std::unique_ptr<eplb_runtime::SlotCopyExecutor> RankEplb::make_executor(model::Backend& backend,
                                                                        comm::Communicator& ep_comm) {
#ifdef FULCRUM_WITH_NCCL
  auto* cuda = dynamic_cast<backend::CudaBackend*>(&backend);
  auto* nccl = dynamic_cast<comm::NcclCommunicator*>(&ep_comm);
  if (cuda != nullptr && nccl != nullptr) {
    if (log_) log_("slot migration: device to device, NCCL P2P on a side stream");
    return std::make_unique<comm::NcclSlotCopyExecutor>(*cuda, *nccl);
  }
#endif
  return std::make_unique<eplb_runtime::BackendSlotCopyExecutor>(backend, ep_comm);
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
  engine.set_routing_hook([recorder = recorder_.get(), previous = engine.routing_hook()](const RoutingRecord& record) {
    recorder->record(record.moe_layer_idx, record.expert_ids);
    if (previous) previous(record);
  });
  if (!settings.enabled) return;

  FULCRUM_CHECK(why_eplb_cannot_run(layout, config).empty(), "EPLB cannot run: {}", why_eplb_cannot_run(layout, config));
  ep_comm_ = world.split(coords.pp_rank * layout.moe_tp_size() + coords.moe_tp_rank, coords.ep_rank);
  eplb_runtime::ManagerOptions manager_options = manager_options_of(settings);
  // Reports count whole slots (every slice), fp32 as the CPU backend holds them.
  manager_options.bytes_per_slot = int64_t{3} * config.moe_intermediate_size * config.hidden_size * int64_t{sizeof(float)};
  if (world.rank() == 0) {
    log_ = eplb_log_of(settings, /*this_rank_logs=*/true);
  }
  // The manager's lines wait for the end of the pass, so the rebalance line can carry the step's time.
  manager_options.log = [this](const std::string& line) { manager_lines_.push_back(line); };
  manager_ = std::make_unique<eplb_runtime::EplbManager>(initial_, std::move(manager_options));
  executor_ = make_executor(backend, *ep_comm_);
  runtime_ = std::make_unique<eplb_runtime::EplbRuntime>(
      *recorder_, *manager_, views, *executor_, world, *ep_comm_, eplb_runtime::MigrationOptions{1, 0},
      [&engine](int moe_layer_idx, std::span<const int32_t> layer_map) {
        engine.commit_layer_placement(moe_layer_idx, layer_map);
      });
}

RankEplb::~RankEplb() = default;

eplb_runtime::PassOutcome RankEplb::after_forward_pass() {
  if (runtime_ == nullptr) {
    recorder_->end_pass();
    return {};
  }
  const auto start = std::chrono::steady_clock::now();
  eplb_runtime::PassOutcome outcome = runtime_->after_forward_pass();  // closes the recorder's pass too
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::vector<std::string> lines = std::move(manager_lines_);
  manager_lines_.clear();
  if (outcome.rebalance) {
    for (std::string& line : lines) {
      if (line == outcome.rebalance->message) line += fmt::format("; EPLB step of this pass {:.1f} ms", 1e3 * seconds);
    }
    migrating_rebalance_ = runtime_->migrating() ? outcome.rebalance->rebalance_idx : -1;
    migration_passes_ = 0;
    migration_seconds_ = 0;
  }
  if (migrating_rebalance_ >= 0) {
    ++migration_passes_;
    migration_seconds_ += seconds;
    if (!runtime_->migrating()) {
      lines.push_back(fmt::format("rebalance {}: migration complete after {} pass(es), {:.1f} ms of EPLB steps "
                                  "(planning included)",
                                  migrating_rebalance_, migration_passes_, 1e3 * migration_seconds_));
      migrating_rebalance_ = -1;
    }
  }
  if (log_) {
    for (const std::string& line : lines) log_(line);
  }
  return outcome;
}

eplb::LoadMatrix RankEplb::own_window_loads() const { return recorder_->window_loads(); }

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
