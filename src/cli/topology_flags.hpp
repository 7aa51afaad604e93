#pragma once
// Flags shared by `plan` and `simulate`: where the physical slots live and which planner fills them.
#include <string>

#include <CLI/CLI.hpp>

#include "cli/number_checks.hpp"
#include "eplb/planner.hpp"

namespace fulcrum::cli {

struct TopologyFlags {
  int num_gpus = 0;
  int num_physical_experts = 0;
  int num_nodes = 1;
  int num_groups = 1;
  std::string algorithm = "fulcrum";

  void add_to(CLI::App* cmd) {
    cmd->add_option("--gpus", num_gpus, "Expert-parallel GPUs (G)")->required()->check(kPositive);
    cmd->add_option("--physical-experts", num_physical_experts, "Physical expert slots per layer (P, multiple of G)")
        ->required()
        ->check(kPositive);
    cmd->add_option("--nodes", num_nodes, "Nodes (G divisible by N)")->check(kPositive)->capture_default_str();
    cmd->add_option("--groups", num_groups, "Expert groups (DeepSeek-V3 style; Qwen3 has none)")
        ->check(kPositive)
        ->capture_default_str();
    cmd->add_option("--algorithm", algorithm, "Planner")
        ->check(CLI::IsMember(eplb::planner_names()))
        ->capture_default_str();
  }

  eplb::PlanOptions plan_options() const {
    eplb::PlanOptions options;
    options.topology = {num_physical_experts, num_gpus, num_nodes};
    options.num_groups = num_groups;
    return options;
  }
};

}  // namespace fulcrum::cli
