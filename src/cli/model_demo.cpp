// The model demo: EPLB closing its loop inside the engine on a model small enough for 2 CPU cores.
// A tiny synthetic Qwen3-MoE (128 experts, top-8) whose routers follow the embedded real Qwen3-30B-A3B
// loads is generated on EP 4 with 8 redundant slots, rebalancing every 4 forward passes (a migration moves
// one layer per pass, so each finishes before the next rebalance); the tokens must
// equal those of the same layout without EPLB (placement never changes what a token computes).
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <random>

#include <fmt/format.h>

#include "cli/demos.hpp"
#include "cli/embedded_loads.hpp"
#include "engine/parallel_generate.hpp"
#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "eplb/metrics.hpp"
#include "model/make_model.hpp"

namespace fulcrum::cli {
namespace {

// A fresh folder under the system's temporary directory, removed with everything in it.
class TempFolder {
 public:
  TempFolder() {
    std::random_device entropy;
    path_ = std::filesystem::temp_directory_path() / fmt::format("fulcrum_demo_{:08x}", entropy());
    std::filesystem::create_directories(path_);
  }
  ~TempFolder() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

void run_model_demo(const DemoFlags& flags) {
  FULCRUM_CHECK(flags.max_new_tokens > 0, "--max-new-tokens must be positive, got {}", flags.max_new_tokens);
  const TempFolder tmp;
  auto start = std::chrono::steady_clock::now();
  write_file_atomically(tmp.file("loads.csv"), embedded_loads_csv());
  model::MakeModelOptions make;
  make.preset = "tiny";  // hidden 64, 128 experts top-8, vocab 256; 4 layers, all MoE
  make.output = tmp.file("model");
  make.seed = 7;
  make.dtype = model::Dtype::kF32;
  make.router_skew = tmp.file("loads.csv");  // MoE layer k follows real layer k
  make.calibration.num_tokens = 1024;
  make.calibration.max_rounds = 4;
  make.measure_tokens = 1024;
  const model::MakeModelResult made = model::make_model(make);
  fmt::print("Fulcrum model demo: live EPLB inside the engine, on CPU ranks\n");
  fmt::print("model: synthetic Qwen3-MoE '{}' preset, {} layers, {} experts top-{}, routers skewed to {} "
             "(fit: Pearson {:.3f} mean); built in {:.1f} s\n",
             make.preset, made.config.num_hidden_layers, made.config.num_experts, made.config.num_experts_per_tok,
             embedded_loads_name(), made.fit ? made.fit->pearson_mean : 0.0, seconds_since(start));

  // 16 prompts of 32 tokens, a pure function of the seed.
  std::mt19937 gen(11);
  std::vector<std::vector<int32_t>> prompts(16);
  for (auto& prompt : prompts) {
    for (int t = 0; t < 32; ++t) prompt.push_back(static_cast<int32_t>(gen() % made.config.vocab_size));
  }
  engine::ParallelFlags parallel;
  parallel.tp = 4;
  parallel.ep = 4;
  parallel.num_redundant_experts = 8;
  const engine::ParallelLayout layout(parallel, made.config);
  engine::InProcessRun run;
  run.engine.dispatch_algorithm = eplb::DispatchAlgorithm::kStatic;
  run.decode.max_new_tokens = flags.max_new_tokens;
  fmt::print("layout: {}\n\n", layout.describe());

  start = std::chrono::steady_clock::now();
  const engine::InProcessResult plain = engine::generate_in_process(make.output, made.config, layout, run, prompts);
  const double plain_seconds = seconds_since(start);

  run.eplb.enabled = true;
  run.eplb.rebalance_num_iterations = 4;
  run.eplb.recorder_buffer_size = 8;
  run.eplb.log = [](const std::string& line) { fmt::print("  {}\n", line); };
  fmt::print("{} sequences x {} new tokens with --enable-eplb --ep-num-redundant-experts 8 "
             "--eplb-rebalance-num-iterations 4 --expert-distribution-recorder-buffer-size 8:\n",
             prompts.size(), flags.max_new_tokens);
  start = std::chrono::steady_clock::now();
  const engine::InProcessResult live = engine::generate_in_process(make.output, made.config, layout, run, prompts);
  const double live_seconds = seconds_since(start);

  const auto before = eplb::evaluate_placement(live.initial_placement, live.window_loads);
  const auto after = eplb::evaluate_placement(live.final_placement, live.window_loads);
  fmt::print("\n{} rebalances; rank 0 received {} slots ({} bytes), copied {} locally; peak staging {} bytes\n",
             live.rebalances.size(), live.migration.num_received, live.migration.bytes_received,
             live.migration.num_local_copies, live.migration.peak_staging_bytes);
  fmt::print("balancedness on the recorded loads (last {} passes): before (trivial placement) {:.4f} -> after "
             "(rebalanced) {:.4f}; lower bound {:.4f}\n",
             run.eplb.recorder_buffer_size, before.balancedness_mean, after.balancedness_mean,
             after.lower_bound_balancedness_mean);
  fmt::print("generation: {:.2f} s without EPLB, {:.2f} s with\n", plain_seconds, live_seconds);
  size_t num_same = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    num_same += live.generated.new_tokens[i] == plain.generated.new_tokens[i];
    fmt::print("seq{}: {}\n", i, fmt::join(live.generated.new_tokens[i], " "));
  }
  // Equal tokens prove something only if some rebalance actually moved expert weights.
  const auto num_applied = std::count_if(live.rebalances.begin(), live.rebalances.end(),
                                         [](const auto& report) { return !report.skipped; });
  const bool pass = num_same == prompts.size() && num_applied > 0;
  fmt::print("{}: {} of {} sequences generate the same tokens with live EPLB as without ({} rebalances, {} applied)\n",
             pass ? "PASS" : "FAIL", num_same, prompts.size(), live.rebalances.size(), num_applied);
  FULCRUM_CHECK(pass, "demo: FAIL: EPLB changed the generated tokens or never changed the placement");
}

}  // namespace fulcrum::cli
