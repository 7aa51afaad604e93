// `fulcrum generate`: greedy decoding of token-id prompts with a Qwen3-MoE checkpoint.
#include <chrono>
#include <cstdio>
#include <memory>
#include <sstream>

#include <fmt/format.h>

#include "backend/cpu/cpu_backend.hpp"
#include "cli/commands.hpp"
#include "eplb/error.hpp"
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
  FULCRUM_CHECK(flags.device == "cpu", "unknown device '{}' (available: cpu)", flags.device);
  FULCRUM_CHECK(flags.max_new_tokens >= 0, "--max-new-tokens must not be negative, got {}", flags.max_new_tokens);
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(flags.model_dir);
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < flags.prompts.size(); ++i) prompts.push_back(parse_prompt(flags.prompts[i], i, config.vocab_size));

  backend::CpuBackend backend;
  model::Qwen3MoeModel qwen(config, backend);
  model::Checkpoint checkpoint(flags.model_dir);
  qwen.load_weights(checkpoint);

  const auto start = std::chrono::steady_clock::now();
  const model::GenerateResult result = model::generate_greedy(qwen, backend, prompts, flags.max_new_tokens);
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
             seconds, backend.name(), checksum);
  if (!flags.dump_logits_file.empty()) fmt::print("# prompt logits written to {}\n", flags.dump_logits_file);
}

}  // namespace

void register_generate_command(CLI::App& app) {
  auto flags = std::make_shared<GenerateFlags>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate tokens from token-id prompts with a Qwen3-MoE checkpoint");
  cmd->add_option("--model", flags->model_dir, "Checkpoint folder (config.json, *.safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--device", flags->device, "Backend")->capture_default_str();
  cmd->add_option("--prompt-tokens", flags->prompts, "Space-separated token ids of one sequence; repeat for a batch")
      ->required();
  cmd->add_option("--max-new-tokens", flags->max_new_tokens, "Tokens to generate per sequence")->capture_default_str();
  cmd->add_flag("--greedy", flags->greedy, "Greedy decoding (argmax, lowest id on ties); the only decoding mode");
  cmd->add_option("--dump-logits", flags->dump_logits_file, "Write prompt logits seq{i}.logits [T][V] (safetensors)");
  cmd->callback([flags] { run_generate(*flags); });
}

}  // namespace fulcrum::cli
