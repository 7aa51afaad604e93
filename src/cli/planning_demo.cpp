// `fulcrum demo --planning`: plans a real Qwen3-30B-A3B load matrix (embedded in the binary) with the
// trivial placement, `deepseek` and `fulcrum` at 8/16/32 GPUs, prints balancedness beside the lower bound,
// and draws per-GPU load before/after as an SVG heatmap.
#include <algorithm>
#include <chrono>
#include <memory>

#include <fmt/format.h>

#include "cli/demos.hpp"
#include "cli/embedded_loads.hpp"
#include "cli/heatmap_svg.hpp"
#include "eplb/atomic_file.hpp"
#include "eplb/metrics.hpp"
#include "eplb/planner.hpp"

namespace fulcrum::cli {
namespace {

struct DemoConfig {
  int num_gpus;
  int num_physical_experts;
};

// Per-GPU load of every layer relative to that layer's mean GPU load; the title gives the worst of them.
HeatmapPanel relative_gpu_loads(const std::string& title, const eplb::Placement& placement,
                                const eplb::LoadMatrix& loads) {
  HeatmapPanel panel{title, placement.num_layers, placement.topology.num_gpus, {}};
  double worst = 0.0;
  for (int l = 0; l < placement.num_layers; ++l) {
    const auto gpu = eplb::gpu_loads(loads.layer(l), placement.layer(l), placement.topology);
    double mean = 0.0;
    for (double v : gpu) mean += v / static_cast<double>(gpu.size());
    for (double v : gpu) {
      panel.values.push_back(mean > 0.0 ? v / mean : 1.0);
      worst = std::max(worst, panel.values.back());
    }
  }
  panel.title += fmt::format(" (max {:.4f}x mean)", worst);
  return panel;
}

double timed_plan(const eplb::Planner& planner, const eplb::LoadMatrix& loads, const eplb::PlanOptions& options,
                  eplb::Placement& out) {
  const auto start = std::chrono::steady_clock::now();
  out = planner.plan(loads, options);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

void run_planning_demo(const DemoFlags& flags) {
  const std::string source = flags.loads_file.empty() ? std::string(embedded_loads_name()) + " (embedded)" : flags.loads_file;
  const eplb::LoadMatrix loads = flags.loads_file.empty()
                                     ? eplb::parse_loads_csv(embedded_loads_csv(), embedded_loads_name())
                                     : eplb::read_loads_file(flags.loads_file);
  fmt::print("Fulcrum EPLB planning demo on real expert loads: {}\n", source);
  fmt::print("{} MoE layers x {} logical experts. Balancedness = mean GPU load / max GPU load (1.0 is perfect).\n\n",
             loads.num_layers, loads.num_logical_experts);
  fmt::print("{:>5} {:>6} | {:>8} {:>9} {:>8} | {:>11} | {:>12} {:>11}\n", "GPUs", "slots", "trivial", "deepseek",
             "fulcrum", "lower bound", "deepseek ms", "fulcrum ms");

  const auto deepseek = eplb::make_planner("deepseek");
  const auto fulcrum = eplb::make_planner("fulcrum");
  const DemoConfig configs[] = {{8, 160}, {16, 160}, {32, 192}};
  std::vector<HeatmapPanel> panels;
  for (const DemoConfig& config : configs) {
    eplb::PlanOptions options;
    options.topology = {config.num_physical_experts, config.num_gpus, 1};
    const eplb::Placement trivial = eplb::trivial_placement(options.topology, loads.num_layers, loads.num_logical_experts);
    eplb::Placement by_deepseek, by_fulcrum;
    const double deepseek_seconds = timed_plan(*deepseek, loads, options, by_deepseek);
    const double fulcrum_seconds = timed_plan(*fulcrum, loads, options, by_fulcrum);
    const auto trivial_report = eplb::evaluate_placement(trivial, loads);
    const auto deepseek_report = eplb::evaluate_placement(by_deepseek, loads);
    const auto fulcrum_report = eplb::evaluate_placement(by_fulcrum, loads);
    fmt::print("{:>5} {:>6} | {:>8.4f} {:>9.4f} {:>8.4f} | {:>11.4f} | {:>12.3f} {:>11.3f}\n", config.num_gpus,
               config.num_physical_experts, trivial_report.balancedness_mean, deepseek_report.balancedness_mean,
               fulcrum_report.balancedness_mean, fulcrum_report.lower_bound_balancedness_mean, deepseek_seconds * 1e3,
               fulcrum_seconds * 1e3);
    if (config.num_gpus == 32) {
      panels.push_back(relative_gpu_loads("before: trivial placement", trivial, loads));
      panels.push_back(relative_gpu_loads("deepseek", by_deepseek, loads));
      panels.push_back(relative_gpu_loads("after: fulcrum", by_fulcrum, loads));
    }
  }
  if (!flags.heatmap_file.empty()) {
    const std::string caption = fmt::format("Per-GPU load / mean, {} at 32 GPUs, 192 slots (rows: MoE layers)", source);
    write_file_atomically(flags.heatmap_file, render_heatmap_svg(caption, panels, 3.0));
    fmt::print("\nHeatmap of per-GPU load before/after (32 GPUs): {}\n", flags.heatmap_file);
  }
}

}  // namespace fulcrum::cli
