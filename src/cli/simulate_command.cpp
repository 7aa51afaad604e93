// `fulcrum simulate`: replay a sequence of load windows with periodic replanning and a dispatch algorithm.
#include <cstdio>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/topology_flags.hpp"
#include "eplb/dispatch.hpp"
#include "eplb/simulate.hpp"

namespace fulcrum::cli {
namespace {

struct SimulateFlags {
  std::vector<std::string> trace_files;
  TopologyFlags topology;
  int rebalance_every = 1;
  std::string dispatch = "static";
  int64_t batch_tokens = 0;
  int batches_per_window = 4;
  int top_k = 8;
  uint64_t seed = 0;
  bool json = false;
};

void run_simulate(const SimulateFlags& flags) {
  std::vector<eplb::LoadMatrix> windows;
  for (const auto& file : flags.trace_files) {
    for (auto& window : eplb::read_load_windows_file(file)) windows.push_back(std::move(window));
  }
  eplb::SimulateOptions options;
  options.topology = flags.topology.plan_options().topology;
  options.num_groups = flags.topology.num_groups;
  options.rebalance_every = flags.rebalance_every;
  options.algorithm = flags.topology.algorithm;
  options.dispatch = eplb::parse_dispatch_algorithm(flags.dispatch);
  options.batch_tokens = flags.batch_tokens;
  options.batches_per_window = flags.batches_per_window;
  options.top_k = flags.top_k;
  options.seed = flags.seed;
  const eplb::SimulateResult result = eplb::simulate(windows, options);

  if (flags.json) {
    nlohmann::json out;
    out["algorithm"] = flags.topology.algorithm;
    out["dispatch"] = flags.dispatch;
    out["num_windows"] = windows.size();
    out["num_gpus"] = options.topology.num_gpus;
    out["num_physical_experts"] = options.topology.num_physical_experts;
    out["rebalance_every"] = flags.rebalance_every;
    out["balancedness_mean"] = result.balancedness_mean;
    out["balancedness_min"] = result.balancedness_min;
    out["balancedness_per_window"] = result.balancedness_per_window;
    out["rebalance_windows"] = result.rebalance_windows;
    out["experts_moved"] = result.experts_moved;
    std::printf("%s\n", out.dump().c_str());
    return;
  }
  fmt::print("{} windows, {} + {} dispatch, {} slots on {} GPUs, rebalance every {} window(s)\n", windows.size(),
             flags.topology.algorithm, flags.dispatch, options.topology.num_physical_experts, options.topology.num_gpus,
             flags.rebalance_every);
  for (size_t t = 0; t < result.balancedness_per_window.size(); ++t) {
    fmt::print("window {:>3}  balancedness {:.4f}\n", t, result.balancedness_per_window[t]);
  }
  int64_t total_moved = 0;
  for (int64_t moved : result.experts_moved) total_moved += moved;
  fmt::print("balancedness mean {:.4f}, worst window {:.4f}; {} rebalances moved {} slots\n", result.balancedness_mean,
             result.balancedness_min, result.experts_moved.size(), total_moved);
}

}  // namespace

void register_simulate_command(CLI::App& app) {
  auto flags = std::make_shared<SimulateFlags>();
  CLI::App* cmd = app.add_subcommand("simulate", "Replay load windows with periodic rebalancing and token dispatch");
  cmd->add_option("--trace", flags->trace_files,
                  "Load windows in order: CSV (one window) or JSON logical_count [S][L][E]; repeat to append")
      ->required()
      ->check(CLI::ExistingFile);
  flags->topology.add_to(cmd);
  cmd->add_option("--rebalance-every", flags->rebalance_every, "Replan every K windows (from the last K windows)")
      ->required()
      ->check(kPositive);
  cmd->add_option("--dispatch", flags->dispatch, "Replica choice per token")
      ->check(CLI::IsMember({"static", "dynamic", "balanced"}))
      ->capture_default_str();
  cmd->add_option("--batch-tokens", flags->batch_tokens, "Replay each window as batches of T sampled tokens (top-8)")
      ->check(kNonNegative);
  cmd->add_option("--batches-per-window", flags->batches_per_window, "Batches per window with --batch-tokens")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--top-k", flags->top_k, "Experts per sampled token with --batch-tokens (Qwen3-MoE: 8)")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--seed", flags->seed, "Seed for sampling and dynamic dispatch")->capture_default_str();
  cmd->add_flag("--json", flags->json, "Print one JSON object");
  cmd->callback([flags] { run_simulate(*flags); });
}

}  // namespace fulcrum::cli
