// `fulcrum plan`: loads in, placement (and its report) out.
#include <chrono>
#include <cstdio>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/topology_flags.hpp"
#include "eplb/fulcrum_planner.hpp"
#include "eplb/metrics.hpp"
#include "eplb/migration_plan.hpp"
#include "eplb/placement_io.hpp"

namespace fulcrum::cli {
namespace {

struct PlanFlags {
  std::vector<std::string> loads_files;
  TopologyFlags topology;
  std::string current_file;
  std::string output_file;
  bool json = false;
};

void run_plan(const PlanFlags& flags) {
  std::vector<eplb::LoadMatrix> matrices;
  for (const auto& file : flags.loads_files) matrices.push_back(eplb::read_loads_file(file));
  const eplb::LoadMatrix loads = eplb::sum_loads(matrices);

  eplb::PlanOptions options = flags.topology.plan_options();
  std::unique_ptr<eplb::Placement> current;
  if (!flags.current_file.empty()) {
    current = std::make_unique<eplb::Placement>(eplb::read_placement_file(flags.current_file));
    options.current = current.get();
  }
  const auto planner = eplb::make_planner(flags.topology.algorithm);
  const auto start = std::chrono::steady_clock::now();
  const eplb::Placement placement = planner->plan(loads, options);
  const double plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const eplb::PlacementReport report = eplb::evaluate_placement(placement, loads);

  if (!flags.output_file.empty()) eplb::write_placement_file(flags.output_file, placement, &loads);
  // Hierarchical view: balancedness of node loads and how many nodes an expert's replicas span.
  double node_balancedness_mean = 1.0, nodes_per_expert_mean = 1.0;
  if (placement.topology.num_nodes > 1) {
    double node_sum = 0.0, spread_sum = 0.0;
    for (int l = 0; l < placement.num_layers; ++l) {
      node_sum += eplb::balancedness(eplb::node_loads(loads.layer(l), placement.layer(l), placement.topology));
      spread_sum += eplb::mean_nodes_per_expert(placement.layer(l), placement.num_logical_experts, placement.topology);
    }
    node_balancedness_mean = node_sum / placement.num_layers;
    nodes_per_expert_mean = spread_sum / placement.num_layers;
  }
  std::unique_ptr<eplb::MigrationPlan> migration;
  if (current) migration = std::make_unique<eplb::MigrationPlan>(eplb::plan_migration(*current, placement));

  if (flags.json) {
    nlohmann::json out;
    out["algorithm"] = planner->name();
    out["num_layers"] = placement.num_layers;
    out["num_logical_experts"] = placement.num_logical_experts;
    out["num_physical_experts"] = placement.num_physical_experts();
    out["num_gpus"] = placement.topology.num_gpus;
    out["num_nodes"] = placement.topology.num_nodes;
    out["balancedness_mean"] = report.balancedness_mean;
    out["balancedness_min"] = report.balancedness_min;
    out["balancedness_per_layer"] = report.balancedness_per_layer;
    out["lower_bound_balancedness_mean"] = report.lower_bound_balancedness_mean;
    if (placement.topology.num_nodes > 1) {
      out["node_balancedness_mean"] = node_balancedness_mean;
      out["nodes_per_expert_mean"] = nodes_per_expert_mean;
    }
    out["plan_seconds"] = plan_seconds;
    if (migration) {
      out["experts_moved"] = migration->num_transfers();
      out["migration"] = {{"local_copies", migration->num_local},
                          {"intra_node_transfers", migration->num_intra_node},
                          {"inter_node_transfers", migration->num_inter_node},
                          {"max_received_per_gpu_layer", migration->max_received_per_gpu_layer}};
    }
    if (!flags.output_file.empty()) out["output"] = flags.output_file;
    std::printf("%s\n", out.dump().c_str());
    return;
  }
  fmt::print("algorithm            {}\n", planner->name());
  fmt::print("layers x experts     {} x {} -> {} slots on {} GPUs ({} nodes)\n", placement.num_layers,
             placement.num_logical_experts, placement.num_physical_experts(), placement.topology.num_gpus,
             placement.topology.num_nodes);
  fmt::print("balancedness         mean {:.4f}  min {:.4f}  (lower bound allows {:.4f})\n", report.balancedness_mean,
             report.balancedness_min, report.lower_bound_balancedness_mean);
  if (placement.topology.num_nodes > 1) {
    fmt::print("per node             balancedness mean {:.4f}; an expert's replicas span {:.2f} nodes on average\n",
               node_balancedness_mean, nodes_per_expert_mean);
  }
  if (migration) {
    fmt::print("experts moved        {} ({} local copies, {} within a node, {} across nodes)\n",
               migration->num_transfers(), migration->num_local, migration->num_intra_node, migration->num_inter_node);
  }
  fmt::print("plan time            {:.3f} ms\n", plan_seconds * 1e3);
  if (!flags.output_file.empty()) fmt::print("placement written to {}\n", flags.output_file);
}

}  // namespace

void register_plan_command(CLI::App& app) {
  auto flags = std::make_shared<PlanFlags>();
  CLI::App* cmd = app.add_subcommand("plan", "Plan an expert placement from recorded loads");
  cmd->add_option("--loads", flags->loads_files, "Load matrix (CSV or JSON logical_count); repeat to sum")
      ->required()
      ->check(CLI::ExistingFile);
  flags->topology.add_to(cmd);
  cmd->add_option("--current", flags->current_file, "Current placement JSON: replan moving as few slots as possible")
      ->check(CLI::ExistingFile);
  cmd->add_option("--output", flags->output_file, "Write the placement JSON here (atomically)");
  cmd->add_flag("--json", flags->json, "Print one JSON object");
  cmd->callback([flags] { run_plan(*flags); });
}

}  // namespace fulcrum::cli
