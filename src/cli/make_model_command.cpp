// `fulcrum make-model`: a random Qwen3-MoE checkpoint from a preset, optionally with skewed routing.
#include <chrono>
#include <memory>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "eplb/error.hpp"
#include "eplb/loads.hpp"
#include "model/make_model.hpp"
#include "tokenizer/tokenizer.hpp"
#include "model/synthetic_model.hpp"

namespace fulcrum::cli {
namespace {

struct MakeModelFlags {
  model::MakeModelOptions options;
  std::string tokenizer_file;
  std::string dtype = "bf16";
  int shard_mib = 2048;
};

void run_make_model(MakeModelFlags& flags) {
  model::MakeModelOptions& options = flags.options;
  options.dtype = model::parse_make_model_dtype(flags.dtype);
  FULCRUM_CHECK(flags.shard_mib > 0, "--shard-mib must be positive, got {}", flags.shard_mib);
  options.max_shard_bytes = static_cast<uint64_t>(flags.shard_mib) << 20;
  if (!flags.tokenizer_file.empty()) {
    // The tokenizer goes beside the weights, and the vocabulary is sized to every id it can produce.
    const int32_t id_bound = tokenizer::Tokenizer::from_file(flags.tokenizer_file).id_bound();
    FULCRUM_CHECK(options.vocab_size == 0 || options.vocab_size == id_bound,
                  "--vocab-size {} conflicts with --tokenizer {} (its ids need vocab_size {})", options.vocab_size,
                  flags.tokenizer_file, id_bound);
    options.vocab_size = id_bound;
    options.extra_files.emplace_back("tokenizer.json", eplb::read_text_file(flags.tokenizer_file));
  }
  const auto start = std::chrono::steady_clock::now();
  const model::MakeModelResult result = model::make_model(options);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const model::Qwen3MoeConfig& c = result.config;
  fmt::print("{}: {} layers, hidden {}, {} experts top-{}, vocab {}: {} parameters, {:.1f} MiB {} in {} file(s), {:.1f} s\n",
             options.output, c.num_hidden_layers, c.hidden_size, c.num_experts, c.num_experts_per_tok, c.vocab_size,
             result.num_parameters, static_cast<double>(result.bytes) / (1 << 20), model::dtype_name(options.dtype),
             result.num_files, seconds);
  if (result.fit) {
    fmt::print("router skew from {}: calibrated in {} round(s) on {} tokens, measured on {} fresh tokens\n",
               options.router_skew, result.calibration->rounds, options.calibration.num_tokens, options.measure_tokens);
    fmt::print("{}", model::router_fit_text(*result.fit));
  }
}

}  // namespace

void register_make_model_command(CLI::App& app) {
  auto flags = std::make_shared<MakeModelFlags>();
  model::MakeModelOptions& o = flags->options;
  CLI::App* cmd = app.add_subcommand("make-model", "Write a random Qwen3-MoE checkpoint (HF layout) from a preset");
  cmd->add_option("--preset", o.preset, "tiny | qwen3-30b-a3b | qwen3-235b-a22b")->required();
  cmd->add_option("--output", o.output, "Checkpoint folder to create (must not exist or be empty)")->required();
  cmd->add_option("--layers", o.layers, "num_hidden_layers (default: the preset's)")->check(CLI::Range(1, 1024));
  cmd->add_option("--experts", o.experts, "num_experts (default: the preset's; top-k shrinks to fit)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--vocab-size", o.vocab_size, "vocab_size (default: the preset's), e.g. a tokenizer's id bound")
      ->check(CLI::Range(1, 1 << 22));
  cmd->add_option("--tokenizer", flags->tokenizer_file,
                  "tokenizer.json to put beside the weights; sizes vocab_size to its ids")
      ->check(CLI::ExistingFile);
  cmd->add_option("--seed", o.seed, "Weights are a function of the seed")->capture_default_str();
  cmd->add_option("--dtype", flags->dtype, "bf16 | fp32 | fp8 (e4m3 linear weights, 128x128 block scales)")->capture_default_str();
  cmd->add_option("--router-skew", o.router_skew,
                  "Load matrix (CSV/JSON, experts = the model's): routing marginals follow it; MoE layer k uses row "
                  "k mod rows")
      ->check(CLI::ExistingFile);
  cmd->add_flag("--allow-large", o.allow_large, "Allow a real-model preset with all its layers");
  cmd->add_option("--shard-mib", flags->shard_mib, "Largest safetensors shard, MiB")->capture_default_str();
  cmd->add_option("--calibration-tokens", o.calibration.num_tokens, "Router-skew calibration tokens")
      ->capture_default_str();
  cmd->add_option("--measure-tokens", o.measure_tokens, "Fresh tokens the reported fit is measured on")
      ->capture_default_str();
  cmd->callback([flags] { run_make_model(*flags); });
}

}  // namespace fulcrum::cli
