// `fulcrum generate`: greedy decoding of token-id prompts with a Qwen3-MoE checkpoint.
#include <chrono>
#include <cstdio>
#include <memory>
#include <sstream>

#include <fmt/format.h>

#include "cli/backend_factory.hpp"
#include "cli/commands.hpp"
#include "engine/parallel_generate.hpp"
#include "eplb/error.hpp"
#include "eplb/placement_io.hpp"
#include "model/generate.hpp"

namespace fulcrum::cli {
namespace {

struct GenerateFlags {
  std::string model_dir;
  std::string device = "cpu";
  std::vector<std::string> prompts;
  int max_new_tokens = 16;
  bool greedy = true;
  std::string dump_logits_file;
  // Parallel engine (in-process ranks); SGLang's flag names.
  engine::ParallelFlags parallel;
  std::string moe_a2a_backend = "allgather";
  std::string dispatch_algorithm = "static";
  std::string init_expert_location = "trivial";

  bool uses_engine() const {
    return parallel.tp != 1 || parallel.dp != 1 || parallel.ep != 1 || parallel.pp != 1 || parallel.enable_dp_attention ||
           parallel.num_redundant_experts != 0 || moe_a2a_backend != "allgather" || dispatch_algorithm != "static" ||
           init_expert_location != "trivial";
  }
};

std::vector<int32_t> parse_prompt(const std::string& text, size_t prompt_idx, int vocab_size) {
  std::vector<int32_t> ids;
  std::istringstream in(text);
  std::string word;
  while (in >> word) {
    size_t used = 0;
    long long id = -1;
    try {
      id = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    FULCRUM_CHECK(used == word.size(), "--prompt-tokens #{}: '{}' is not a token id", prompt_idx + 1, word);
    FULCRUM_CHECK(id >= 0 && id < vocab_size, "--prompt-tokens #{}: token id {} out of range [0, {})", prompt_idx + 1,
                  id, vocab_size);
    ids.push_back(static_cast<int32_t>(id));
  }
  FULCRUM_CHECK(!ids.empty(), "--prompt-tokens #{}: no token ids", prompt_idx + 1);
  return ids;
}

void run_generate(const GenerateFlags& flags) {
  FULCRUM_CHECK(flags.device != "cuda" || !flags.uses_engine(), "--device {}: the parallel engine runs on cpu only",
                flags.device);
  FULCRUM_CHECK(flags.max_new_tokens >= 0, "--max-new-tokens must not be negative, got {}", flags.max_new_tokens);
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(flags.model_dir);
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < flags.prompts.size(); ++i) prompts.push_back(parse_prompt(flags.prompts[i], i, config.vocab_size));

  const std::unique_ptr<model::Backend> backend_owner = make_backend(flags.device);  // "cpu" or "cuda"
  model::Backend& backend = *backend_owner;
  const auto start = std::chrono::steady_clock::now();
  model::GenerateResult result;
  std::string where = backend.name();
  if (flags.uses_engine()) {
    const engine::ParallelLayout layout(flags.parallel, config);
    engine::EngineOptions options;
    options.moe_a2a_backend = flags.moe_a2a_backend;
    options.dispatch_algorithm = eplb::parse_dispatch_algorithm(flags.dispatch_algorithm);
    std::unique_ptr<eplb::Placement> placement;
    if (flags.init_expert_location != "trivial") {
      placement = std::make_unique<eplb::Placement>(eplb::read_placement_file(flags.init_expert_location));
    }
    result = engine::generate_in_process(flags.model_dir, config, layout, placement.get(), options, prompts,
                                         flags.max_new_tokens);
    fmt::print("# layout: {}\n", layout.describe());
    where = fmt::format("{} x {} in-process ranks", backend.name(), layout.world_size());
  } else {
    model::Qwen3MoeModel qwen(config, backend);
    model::Checkpoint checkpoint(flags.model_dir);
    qwen.load_weights(checkpoint);
    result = model::generate_greedy(qwen, backend, prompts, flags.max_new_tokens);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  if (!flags.dump_logits_file.empty()) {
    std::map<std::string, model::HostTensor> dump;
    for (size_t i = 0; i < prompts.size(); ++i) dump["seq" + std::to_string(i) + ".logits"] = result.prompt_logits[i];
    model::write_safetensors(flags.dump_logits_file, dump, {{"format", "pt"}});
  }
  double checksum = 0;  // sum of all prompt logits: a quick fingerprint to compare runs and devices
  size_t num_tokens = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (const float v : result.prompt_logits[i].data) checksum += v;
    num_tokens += prompts[i].size() + result.new_tokens[i].size();
    fmt::print("seq{}: {}\n", i, fmt::join(result.new_tokens[i], " "));
  }
  fmt::print("# {} sequences, {} tokens in {:.3f} s on {}, prompt logits checksum {:.6f}\n", prompts.size(), num_tokens,
             seconds, where, checksum);
  if (!flags.dump_logits_file.empty()) fmt::print("# prompt logits written to {}\n", flags.dump_logits_file);
}

}  // namespace

void register_generate_command(CLI::App& app) {
  auto flags = std::make_shared<GenerateFlags>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate tokens from token-id prompts with a Qwen3-MoE checkpoint");
  cmd->add_option("--model", flags->model_dir, "Checkpoint folder (config.json, *.safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--device", flags->device, "Backend: cpu | cuda")->capture_default_str();
  cmd->add_option("--prompt-tokens", flags->prompts, "Space-separated token ids of one sequence; repeat for a batch")
      ->required();
  cmd->add_option("--max-new-tokens", flags->max_new_tokens, "Tokens to generate per sequence")->capture_default_str();
  cmd->add_flag("--greedy", flags->greedy, "Greedy decoding (argmax, lowest id on ties); the only decoding mode");
  cmd->add_option("--dump-logits", flags->dump_logits_file, "Write prompt logits seq{i}.logits [T][V] (safetensors)");
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
                  "'trivial' or a placement JSON file (physical_to_logical_map [MoE layers][P])")
      ->capture_default_str();
  cmd->callback([flags] { run_generate(*flags); });
}

}  // namespace fulcrum::cli
