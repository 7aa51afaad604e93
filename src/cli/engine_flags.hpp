#pragma once
// Flags of the parallel engine and live EPLB (SGLang's names), defined once and shared by `generate` and
// `serve`: device, weight cache, layout, token dispatch, initial placement, EPLB and its recorder.
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "engine/moe_a2a_backend.hpp"
#include "engine/parallel_generate.hpp"

namespace fulcrum::cli {

struct EngineFlags {
  std::string device = "cpu";
  std::string weight_cache_dir;
  bool fp8_dense_gemms = false;
  engine::ParallelFlags parallel;
  std::string moe_a2a_backend = "allgather";  // any name of engine/moe_a2a_backend.hpp
  bool a2a_given = false, ep_given = false;
  bool enable_deepep_moe = false;   // SGLang's older spelling of --moe-a2a-backend deepep
  std::string deepep_mode;          // normal | low_latency | auto; empty: not given
  bool trust_remote_code = false;   // accepted for SGLang's command lines; no checkpoint code runs here
  std::string dispatch_algorithm = "static";
  std::string init_expert_location = "trivial";
  bool enable_eplb = false;
  std::string recorder_mode = "stat";
  engine::EplbSettings eplb;
  std::vector<std::string> eplb_only_flags_given;  // flags that do nothing without --enable-eplb

  // Registers the flags on `cmd`; `flags` must live as long as the app (the CLI writes into it).
  static void add_to(CLI::App* cmd, const std::shared_ptr<EngineFlags>& flags);

  // The backend --moe-a2a-backend / --enable-deepep-moe name (one-line error on a conflict or an unknown name).
  engine::MoeA2aBackend a2a_backend() const;
  // The layout flags with SGLang's default applied: a DeepEP-class backend without --ep makes --ep = --tp.
  engine::ParallelFlags resolved_parallel() const;
  // What the SGLang-only flags turned into, one line each (make_run prints them as `fulcrum: note:`).
  std::vector<std::string> notes() const;

  // Checks the values (one-line errors) and turns them into a run of the engine on `layout`. Conditions
  // that turn EPLB off are said on stderr (`fulcrum: warning:`), never silently applied.
  engine::InProcessRun make_run(const engine::ParallelLayout& layout, const model::Qwen3MoeConfig& config) const;
};

}  // namespace fulcrum::cli
