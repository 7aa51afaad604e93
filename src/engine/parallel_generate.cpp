#include "engine/parallel_generate.hpp"

#include <filesystem>

#include <fmt/format.h>

#include "engine/backend_factory.hpp"
#include "comm/in_process_communicator.hpp"
#include "eplb/error.hpp"
#include "eplb_runtime/eplb_manager.hpp"
#include "eplb_runtime/initial_placement.hpp"

namespace fulcrum::engine {
namespace {

void load_rank_weights(model::Qwen3MoeModel& model, const std::string& model_dir, const InProcessRun& run, int rank) {
  const std::string& cache_dir = run.weight_cache_dir;
  const std::string cache_file = cache_dir.empty() ? "" : fmt::format("{}/rank{}.safetensors", cache_dir, rank);
  const auto progress = [&](int done, int total) {
    if (run.on_layer_loaded) run.on_layer_loaded(rank, done, total);
  };
  FULCRUM_CHECK(!run.read_expert_slot || cache_dir.empty(),
                "rank {}: expert slots written by the caller cannot load from a weight cache", rank);
  if (!cache_file.empty() && std::filesystem::exists(cache_file)) {
    model.load_weight_cache(cache_file);
    const int owned = model.end_layer() - model.start_layer();
    progress(owned, owned);
    return;
  }
  model::Checkpoint checkpoint(model_dir);
  model.load_weights(checkpoint, progress, run.read_expert_slot);
  if (!cache_file.empty()) {
    std::filesystem::create_directories(cache_dir);
    model.save_weight_cache(cache_file);
  }
}

}  // namespace

std::vector<model::HostTensor> RankDecodeTarget::forward(const std::vector<std::vector<int32_t>>& new_tokens) {
  std::vector<model::HostTensor> logits = engine_.forward(new_tokens);
  if (eplb_ != nullptr) eplb_->after_forward_pass();
  return logits;
}

eplb::Placement prepare_in_process_run(const model::Qwen3MoeConfig& config, const ParallelLayout& layout,
                                       const InProcessRun& run) {
  const int num_moe_layers = static_cast<int>(config.moe_layer_indices().size());
  FULCRUM_CHECK(num_moe_layers > 0 || run.dump_file.empty(),
                "--expert-distribution-dump: the model has no MoE layer to record");
  if (run.eplb.enabled) {
    const std::string why = why_eplb_cannot_run(layout, config);
    FULCRUM_CHECK(why.empty(), "EPLB cannot run: {}", why);
  }
  if (records_routing(config, run)) validate_eplb_settings(run.eplb);
  if (num_moe_layers == 0) return {};
  const eplb::Topology topo{layout.num_physical_experts(), layout.ep(), 1};
  return eplb_runtime::make_initial_placement(run.init_expert_location, topo, num_moe_layers, config.num_experts,
                                              eplb_runtime::default_planner_name());
}

bool runs_gpu_engine_ranks(const ParallelFlags& f, const InProcessRun& run) {
  return run.device == "cuda" && f.tp > 1 && f.pp == 1 && f.ep == f.tp && f.dp == f.tp && f.enable_dp_attention;
}

std::string why_gpu_engine_ranks_cannot_run(const InProcessRun& run) {
  if (!run.weight_cache_dir.empty()) {
    return "--weight-cache: not with the GPU engine's expert-parallel ranks yet (each rank holds part of the slots)";
  }
  return {};
}

bool records_routing(const model::Qwen3MoeConfig& config, const InProcessRun& run) {
  return !config.moe_layer_indices().empty() && (run.record || run.eplb.enabled || !run.dump_file.empty());
}

InProcessRank build_in_process_rank(const std::string& model_dir, const model::Qwen3MoeConfig& config,
                                    const ParallelLayout& layout, const InProcessRun& run,
                                    const eplb::Placement& initial, comm::Communicator& world) {
  const bool has_moe = !config.moe_layer_indices().empty();
  InProcessRank rank;
  rank.backend = make_backend(run.device);
  rank.engine = std::make_unique<RankEngine>(config, layout, world, *rank.backend, has_moe ? &initial : nullptr,
                                             run.engine);
  load_rank_weights(rank.engine->model(), model_dir, run, world.rank());
  if (records_routing(config, run)) {
    rank.eplb = std::make_unique<RankEplb>(*rank.engine, world, *rank.backend, initial, run.eplb);
  }
  return rank;
}

InProcessResult prepare_generate(const model::Qwen3MoeConfig& config, const ParallelLayout& layout,
                                 const InProcessRun& run) {
  InProcessResult result;
  result.initial_placement = prepare_in_process_run(config, layout, run);
  return result;
}

void generate_on_rank(int rank, comm::Communicator& world, const std::string& model_dir,
                      const model::Qwen3MoeConfig& config, const ParallelLayout& layout, const InProcessRun& run,
                      const std::vector<std::vector<int32_t>>& prompts, InProcessResult& result) {
  InProcessRank me = build_in_process_rank(model_dir, config, layout, run, result.initial_placement, world);
  RankDecodeTarget target(*me.engine, me.eplb.get());
  model::GenerateResult mine = model::generate(target, prompts, run.decode);
  eplb::LoadMatrix window;
  if (me.eplb != nullptr) {
    window = me.eplb->merged_window_loads();
    if (!run.dump_file.empty()) me.eplb->dump(run.dump_file);
  }
  if (rank != 0) return;
  result.generated = std::move(mine);
  result.window_loads = std::move(window);
  result.final_placement = me.eplb != nullptr ? me.eplb->live_placement() : result.initial_placement;
  if (const TokenDispatcher* dispatcher = me.engine->dispatcher()) {
    result.moe_row_path = std::string(dispatcher->row_exchange().path());
    result.moe_row_collectives = dispatcher->row_exchange().calls();
  }
  if (me.eplb != nullptr) {
    result.rebalances = me.eplb->rebalances();
    result.migration = me.eplb->migration_totals();
  }
}

InProcessResult generate_in_process(const std::string& model_dir, const model::Qwen3MoeConfig& config,
                                    const ParallelLayout& layout, const InProcessRun& run,
                                    const std::vector<std::vector<int32_t>>& prompts) {
  InProcessResult result = prepare_generate(config, layout, run);
  comm::run_in_process(layout.world_size(), [&](int rank, comm::Communicator& world) {
    generate_on_rank(rank, world, model_dir, config, layout, run, prompts, result);
  });
  return result;
}

}  // namespace fulcrum::engine
