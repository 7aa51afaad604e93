#include "eplb/planner.hpp"

#include <cmath>

#include <fmt/ranges.h>

namespace fulcrum::eplb {

Placement Planner::plan(const LoadMatrix& loads, const PlanOptions& options) const {
  FULCRUM_CHECK(loads.num_layers > 0 && loads.num_logical_experts > 0, "load matrix is empty");
  options.topology.validate(loads.num_logical_experts, loads.num_layers);  // before the placement is allocated
  FULCRUM_CHECK(options.num_groups > 0, "--groups must be positive, got {}", options.num_groups);
  for (double v : loads.values) FULCRUM_CHECK(std::isfinite(v) && v >= 0.0, "load {} is not a finite value >= 0", v);
  if (options.current != nullptr) {
    const Placement& current = *options.current;
    current.validate();
    FULCRUM_CHECK(current.num_layers == loads.num_layers && current.num_logical_experts == loads.num_logical_experts,
                  "current placement is {} layers x {} experts but the loads are {} layers x {} experts",
                  current.num_layers, current.num_logical_experts, loads.num_layers, loads.num_logical_experts);
    FULCRUM_CHECK(current.topology.num_physical_experts == options.topology.num_physical_experts &&
                      current.topology.num_gpus == options.topology.num_gpus &&
                      current.topology.num_nodes == options.topology.num_nodes,
                  "current placement has {} slots on {} GPUs in {} nodes but the plan asks for {} slots on {} GPUs in "
                  "{} nodes",
                  current.topology.num_physical_experts, current.topology.num_gpus, current.topology.num_nodes,
                  options.topology.num_physical_experts, options.topology.num_gpus, options.topology.num_nodes);
  }
  Placement result(options.topology, loads.num_layers, loads.num_logical_experts);
  for (int layer_idx = 0; layer_idx < loads.num_layers; ++layer_idx) {
    std::span<const int32_t> current_map;
    if (options.current != nullptr) current_map = options.current->layer(layer_idx);
    plan_layer(loads.layer(layer_idx), options, current_map, result.layer(layer_idx));
  }
  result.validate();
  return result;
}

std::vector<std::string> planner_names() { return {"fulcrum", "deepseek"}; }

std::unique_ptr<Planner> make_planner(std::string_view name) {
  if (name == "fulcrum") return make_fulcrum_planner();
  if (name == "deepseek") return make_deepseek_planner();
  throw Error(fmt::format("unknown planner '{}' (known: {})", name, fmt::join(planner_names(), ", ")));
}

}  // namespace fulcrum::eplb
