#include "cli/engine_flags.hpp"

#include <cstdio>

#include <fmt/format.h>

#include "engine/multi_process_run.hpp"
#include "eplb/error.hpp"

namespace fulcrum::cli {
namespace {

// A launched rank process stays quiet: its launcher already said it.
void warn(const std::string& line) {
  if (!engine::launched_rank()) std::fprintf(stderr, "fulcrum: warning: %s\n", line.c_str());
}

}  // namespace

void EngineFlags::add_to(CLI::App* cmd, const std::shared_ptr<EngineFlags>& flags) {
  cmd->add_option("--device", flags->device, "Backend: cpu | cuda (cuda: one rank)")->capture_default_str();
  cmd->add_option("--weight-cache", flags->weight_cache_dir,
                  "Folder of per-rank weight caches: loaded when present (skipping the checkpoint), else written");
  cmd->add_option("--tp", flags->parallel.tp, "Ranks per pipeline stage (tensor parallel)")->capture_default_str();
  cmd->add_option("--dp", flags->parallel.dp, "Attention data-parallel groups (with --enable-dp-attention)")
      ->capture_default_str();
  cmd->add_flag("--enable-dp-attention", flags->parallel.enable_dp_attention,
                "Attention as --dp groups of --tp/--dp ranks, each with its own sequences");
  cmd->add_option("--ep", flags->parallel.ep, "Expert-parallel ranks per stage (divides --tp)")->capture_default_str();
  cmd->add_option("--pp", flags->parallel.pp, "Pipeline stages")->capture_default_str();
  cmd->add_option("--moe-a2a-backend", flags->moe_a2a_backend, "Token dispatch: allgather | alltoall")
      ->check(CLI::IsMember({"allgather", "alltoall"}))
      ->capture_default_str();
  cmd->add_option("--ep-dispatch-algorithm", flags->dispatch_algorithm, "Replica choice: static | dynamic | balanced")
      ->check(CLI::IsMember({"static", "dynamic", "balanced"}))
      ->capture_default_str();
  cmd->add_option("--ep-num-redundant-experts", flags->parallel.num_redundant_experts,
                  "Redundant expert slots per MoE layer (P = num_experts + R, divisible by --ep)")
      ->capture_default_str();
  cmd->add_option("--init-expert-location", flags->init_expert_location,
                  "'trivial', a placement JSON (physical_to_logical_map [MoE layers][P]) or a loads file planned at start")
      ->capture_default_str();
  cmd->add_flag("--enable-eplb", flags->enable_eplb, "Rebalance expert placement live (needs --ep > 1)");
  cmd->add_option("--eplb-rebalance-num-iterations", flags->eplb.rebalance_num_iterations,
                  "Forward passes between rebalances")
      ->capture_default_str()
      ->each([flags](const std::string&) { flags->eplb_only_flags_given.push_back("--eplb-rebalance-num-iterations"); });
  cmd->add_option("--eplb-rebalance-layers-per-chunk", flags->eplb.rebalance_layers_per_chunk,
                  "MoE layers per rebalance (0: all)")
      ->capture_default_str()
      ->each([flags](const std::string&) { flags->eplb_only_flags_given.push_back("--eplb-rebalance-layers-per-chunk"); });
  cmd->add_option("--expert-distribution-recorder-mode", flags->recorder_mode, "stat | per_pass | per_token")
      ->capture_default_str();
  cmd->add_option("--expert-distribution-recorder-buffer-size", flags->eplb.recorder_buffer_size,
                  "Forward passes in the recorder's window")
      ->capture_default_str();
}

engine::InProcessRun EngineFlags::make_run(const engine::ParallelLayout& layout,
                                           const model::Qwen3MoeConfig& config) const {
  FULCRUM_CHECK(device == "cpu" || device == "cuda", "unknown device '{}' (available: cpu, cuda)", device);
  if (layout.tp() != parallel.tp && !engine::launched_rank()) {
    fmt::print(stderr, "fulcrum: note: --tp {} --dp {} --ep {} read as --tp {} (attention TP {} in each of {} DP groups): {}\n",
               parallel.tp, parallel.dp, parallel.ep, layout.tp(), layout.attn_tp_size(), layout.attn_dp_size(),
               layout.describe());
  }
  engine::InProcessRun run;
  run.device = device;
  run.weight_cache_dir = weight_cache_dir;
  run.init_expert_location = init_expert_location;
  run.engine.moe_a2a_backend = moe_a2a_backend;
  run.engine.dispatch_algorithm = eplb::parse_dispatch_algorithm(dispatch_algorithm);
  run.eplb = eplb;
  run.eplb.recorder_mode = eplb_runtime::parse_recorder_mode(recorder_mode);
  run.eplb.enabled = enable_eplb;
  engine::validate_eplb_settings(run.eplb);
  if (enable_eplb) {
    const std::string why = engine::why_eplb_cannot_run(layout, config);
    if (!why.empty()) {
      warn("--enable-eplb: EPLB disabled: " + why);
      run.eplb.enabled = false;
    }
  } else {
    for (const std::string& flag : eplb_only_flags_given) warn(flag + " has no effect without --enable-eplb");
  }
  return run;
}

}  // namespace fulcrum::cli
