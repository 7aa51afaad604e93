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
  cmd->add_option("--device", flags->device, "Backend: cpu | cuda (the GPU engine on one GPU; with --tp W --dp W --enable-dp-attention --ep W, W GPU engine ranks as threads)")->capture_default_str();
  cmd->add_option("--weight-cache", flags->weight_cache_dir,
                  "Folder of per-rank weight caches: loaded when present (skipping the checkpoint), else written");
  cmd->add_flag("--fp8-dense-gemms", flags->fp8_dense_gemms,
                "--device cuda, FP8 checkpoints: keep qkv / o / dense MLP FP8 on the GPU (half their memory; slower "
                "than the default bf16 copies at 8 rows a step and more)");
  cmd->add_option("--tp", flags->parallel.tp,
                  "Ranks per pipeline stage, every attention-DP group included (SGLang's --tp)")
      ->capture_default_str();
  cmd->add_option("--dp", flags->parallel.dp, "Attention data-parallel groups (with --enable-dp-attention)")
      ->capture_default_str();
  cmd->add_flag("--enable-dp-attention", flags->parallel.enable_dp_attention,
                "Attention as --dp groups of --tp/--dp ranks, each with its own sequences");
  cmd->add_option("--ep", flags->parallel.ep,
                  "Expert-parallel ranks per stage (divides --tp; default 1, --tp with a DeepEP-class backend)")
      ->capture_default_str()
      ->each([flags](const std::string&) { flags->ep_given = true; });
  cmd->add_option("--pp", flags->parallel.pp, "Pipeline stages")->capture_default_str();
  cmd->add_option("--moe-a2a-backend", flags->moe_a2a_backend,
                  "Token dispatch: allgather (SGLang: none) | alltoall (SGLang: deepep, mooncake, mori, nixl)")
      ->capture_default_str()
      ->each([flags](const std::string&) { flags->a2a_given = true; });
  cmd->add_flag("--enable-deepep-moe", flags->enable_deepep_moe, "SGLang's older --moe-a2a-backend deepep");
  cmd->add_option("--deepep-mode", flags->deepep_mode,
                  "SGLang's DeepEP mode: normal | low_latency | auto (alltoall has one mode; accepted)")
      ->check(CLI::IsMember({"normal", "low_latency", "auto"}));
  cmd->add_flag("--trust-remote-code,--trust-remote", flags->trust_remote_code,
                "Accepted for SGLang's command lines: no code from the checkpoint runs (Qwen3-MoE is built in)");
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

engine::MoeA2aBackend EngineFlags::a2a_backend() const {
  FULCRUM_CHECK(!enable_deepep_moe || !a2a_given || moe_a2a_backend == "deepep",
                "--enable-deepep-moe conflicts with --moe-a2a-backend {}", moe_a2a_backend);
  return engine::resolve_moe_a2a_backend(enable_deepep_moe ? "deepep" : moe_a2a_backend);
}

engine::ParallelFlags EngineFlags::resolved_parallel() const {
  engine::ParallelFlags out = parallel;
  if (a2a_backend().deepep_class && !ep_given) out.ep = parallel.tp;
  return out;
}

std::vector<std::string> EngineFlags::notes() const {
  std::vector<std::string> lines;
  const engine::MoeA2aBackend a2a = a2a_backend();
  const std::string named = enable_deepep_moe ? "--enable-deepep-moe" : "--moe-a2a-backend " + a2a.given;
  if (a2a.given != a2a.dispatcher) {
    std::string line = fmt::format("{} runs Fulcrum's {} dispatch", named, a2a.dispatcher);
    if (a2a.deepep_class) line += " (each token only to the ranks holding its chosen replica)";
    if (a2a.deepep_class && !ep_given) line += fmt::format("; --ep defaults to --tp as in SGLang: --ep {}", parallel.tp);
    lines.push_back(line);
  }
  if (!deepep_mode.empty()) {
    lines.push_back(a2a.deepep_class
                        ? fmt::format("--deepep-mode {}: alltoall has one mode (counts exchanged first, then the rows)",
                                      deepep_mode)
                        : fmt::format("--deepep-mode {} has no effect with the {} dispatch", deepep_mode, a2a.dispatcher));
  }
  if (trust_remote_code) lines.push_back("--trust-remote-code: no code from the checkpoint runs (Qwen3-MoE is built in)");
  return lines;
}

engine::InProcessRun EngineFlags::make_run(const engine::ParallelLayout& layout,
                                           const model::Qwen3MoeConfig& config) const {
  FULCRUM_CHECK(device == "cpu" || device == "cuda", "unknown device '{}' (available: cpu, cuda)", device);
  if (!engine::launched_rank()) {
    for (const std::string& line : notes()) fmt::print(stderr, "fulcrum: note: {}\n", line);
  }
  engine::InProcessRun run;
  run.device = device;
  run.weight_cache_dir = weight_cache_dir;
  run.fp8_dense_gemms = fp8_dense_gemms;
  if (fp8_dense_gemms && device != "cuda") warn("--fp8-dense-gemms has no effect without --device cuda");
  run.init_expert_location = init_expert_location;
  run.engine.moe_a2a_backend = a2a_backend().dispatcher;
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
