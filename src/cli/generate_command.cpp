// `fulcrum generate`: token-id prompts through a Qwen3-MoE checkpoint on the parallel engine (in-process ranks,
// or one process per rank over one or several nodes; one rank by default), greedy or sampled, optionally with
// the EPLB loop running between passes.
#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/dist_flags.hpp"
#include "cli/engine_flags.hpp"
#include "cli/gpu_commands.hpp"
#include "cli/token_ids.hpp"
#include "engine/multi_process_run.hpp"
#include "engine/parallel_generate.hpp"
#include "eplb/error.hpp"
#include "eplb/metrics.hpp"

namespace fulcrum::cli {
namespace {

struct GenerateFlags {
  std::string model_dir;
  std::vector<std::string> prompts;
  int max_new_tokens = 16;
  bool greedy = false;
  model::SamplingParams sampling;
  uint64_t seed = 0;
  std::string dump_logits_file;
  std::shared_ptr<EngineFlags> engine = std::make_shared<EngineFlags>();
  std::string expert_distribution_dump;
  engine::DistFlags dist;  // ranks as processes, over one or several nodes
};

std::vector<int32_t> parse_prompt(const std::string& text, size_t prompt_idx, int vocab_size) {
  const std::string what = fmt::format("--prompt-tokens #{}", prompt_idx + 1);
  std::vector<int32_t> ids = parse_token_ids(text, what, vocab_size);
  FULCRUM_CHECK(!ids.empty(), "{}: no token ids", what);
  return ids;
}

void run_generate(GenerateFlags& flags) {
  FULCRUM_CHECK(flags.max_new_tokens >= 0, "--max-new-tokens must not be negative, got {}", flags.max_new_tokens);
  FULCRUM_CHECK(!(flags.greedy && flags.sampling.temperature > 0.0f), "--greedy conflicts with --temperature {}",
                flags.sampling.temperature);
  model::validate_sampling_params(flags.sampling);
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(flags.model_dir);
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < flags.prompts.size(); ++i) prompts.push_back(parse_prompt(flags.prompts[i], i, config.vocab_size));
  const engine::ParallelLayout layout(flags.engine->resolved_parallel(), config);
  engine::validate_dist_flags(flags.dist, layout.world_size());
  const std::optional<engine::LaunchedRank> me = engine::launched_rank();
  const bool as_processes = me || engine::runs_as_processes(flags.dist, flags.engine->device, layout.world_size());
  engine::InProcessRun run = flags.engine->make_run(layout, config);
  run.eplb.log = [](const std::string& line) { fmt::print("# eplb: {}\n", line); };
  run.dump_file = flags.expert_distribution_dump;
  run.decode = {flags.max_new_tokens, flags.sampling, flags.seed};

#ifdef FULCRUM_WITH_CUDA
  // One GPU: the GPU engine runs the whole step on the device (src/gpu/). Attention data-parallel + expert-parallel
  // ranks on one node without --multi-process: GPU engines as threads; other layouts stay on the engine's ranks.
  if (run.device == "cuda" && layout.world_size() == 1 && !me && flags.dist.nnodes == 1) {
    generate_on_gpu(flags.model_dir, config, layout, run, prompts, flags.dump_logits_file);
    return;
  }
  if (engine::runs_gpu_engine_ranks(layout.flags(), run) && !me && flags.dist.nnodes == 1 && !flags.dist.multi_process) {
    generate_on_gpu_ranks(flags.model_dir, config, layout, run, prompts, flags.dump_logits_file);
    return;
  }
#endif
  const auto start = std::chrono::steady_clock::now();
  if (as_processes && !me) {  // the launcher: its rank processes generate, world rank 0 prints
    engine::launch_rank_processes(flags.dist, layout.world_size(), run.device);
    return;
  }
  const engine::InProcessResult result =
      me ? engine::generate_as_rank(*me, flags.model_dir, config, layout, run, prompts)
         : engine::generate_in_process(flags.model_dir, config, layout, run, prompts);
  if (me && me->world_rank != 0) return;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  if (!flags.dump_logits_file.empty()) {
    std::map<std::string, model::HostTensor> dump;
    for (size_t i = 0; i < prompts.size(); ++i) {
      dump["seq" + std::to_string(i) + ".logits"] = result.generated.prompt_logits[i];
    }
    model::write_safetensors(flags.dump_logits_file, dump, {{"format", "pt"}});
  }
  fmt::print("# layout: {}\n", layout.describe());
  double checksum = 0;  // sum of all prompt logits: a quick fingerprint to compare runs and devices
  size_t num_tokens = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (const float v : result.generated.prompt_logits[i].data) checksum += v;
    num_tokens += prompts[i].size() + result.generated.new_tokens[i].size();
    fmt::print("seq{}: {}\n", i, fmt::join(result.generated.new_tokens[i], " "));
  }
  fmt::print("# {} sequences, {} tokens in {:.3f} s on {} x {} {} ranks, prompt logits checksum {:.6f}\n",
             prompts.size(), num_tokens, seconds, run.device, layout.world_size(),
             as_processes ? "process" : "in-process", checksum);
  if (!result.moe_row_path.empty()) {
    fmt::print("# moe exchange: {} ({} path for the token rows, {} row collectives on rank 0)\n",
               run.engine.moe_a2a_backend, result.moe_row_path, result.moe_row_collectives);
  }
  if (run.eplb.enabled) {
    const auto before = eplb::evaluate_placement(result.initial_placement, result.window_loads);
    const auto after = eplb::evaluate_placement(result.final_placement, result.window_loads);
    const auto changed = std::count_if(result.rebalances.begin(), result.rebalances.end(),
                                       [](const auto& report) { return !report.skipped; });
    fmt::print("# eplb: {} rebalances ({} changed the placement), {} slots received over the network by rank 0; "
               "recorder window balancedness: initial placement {:.4f} -> live placement {:.4f}\n",
               result.rebalances.size(), changed, result.migration.num_received, before.balancedness_mean,
               after.balancedness_mean);
  }
  if (!flags.dump_logits_file.empty()) fmt::print("# prompt logits written to {}\n", flags.dump_logits_file);
  if (!run.dump_file.empty()) fmt::print("# expert distribution written to {}\n", run.dump_file);
}

}  // namespace

void register_generate_command(CLI::App& app) {
  auto flags = std::make_shared<GenerateFlags>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate tokens from token-id prompts with a Qwen3-MoE checkpoint");
  cmd->add_option("--model,--model-path", flags->model_dir, "Checkpoint folder (config.json, *.safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--prompt-tokens", flags->prompts, "Space-separated token ids of one sequence; repeat for a batch")
      ->required();
  cmd->add_option("--max-new-tokens", flags->max_new_tokens, "Tokens to generate per sequence")->capture_default_str();
  cmd->add_flag("--greedy", flags->greedy, "Greedy decoding (argmax, lowest id on ties); the default");
  cmd->add_option("--temperature", flags->sampling.temperature, "Sampling temperature (0: greedy)")->capture_default_str();
  cmd->add_option("--top-p", flags->sampling.top_p, "Nucleus sampling threshold in (0, 1]")->capture_default_str();
  cmd->add_option("--top-k", flags->sampling.top_k, "Keep the k most likely tokens (0: all)")->capture_default_str();
  cmd->add_option("--seed", flags->seed, "Sampling seed (every rank draws the same tokens)")->capture_default_str();
  cmd->add_option("--dump-logits", flags->dump_logits_file, "Write prompt logits seq{i}.logits [T][V] (safetensors)");
  EngineFlags::add_to(cmd, flags->engine);
  cmd->add_option("--expert-distribution-dump", flags->expert_distribution_dump,
                  "Write the recorder's window (JSON that `fulcrum plan --loads` reads)");
  add_dist_flags(cmd, flags->dist);
  cmd->callback([flags] { run_generate(*flags); });
}

}  // namespace fulcrum::cli
