#include "eplb_runtime/initial_placement.hpp"

#include <nlohmann/json.hpp>

#include "eplb/json_text.hpp"
#include "eplb/loads.hpp"
#include "eplb/placement_io.hpp"
#include "eplb/planner.hpp"

namespace fulcrum::eplb_runtime {

namespace {

bool is_placement_json(const std::string& text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos || text[first] != '{') return false;
  return text.find("\"physical_to_logical_map\"") != std::string::npos;
}

}  // namespace

eplb::Placement make_initial_placement(const std::string& spec, const eplb::Topology& topology, int num_moe_layers,
                                       int num_logical_experts, std::string_view planner_name) {
  topology.validate(num_logical_experts);
  FULCRUM_CHECK(num_moe_layers > 0, "initial expert placement: the model has no MoE layer");
  if (spec == "trivial") return eplb::trivial_placement(topology, num_moe_layers, num_logical_experts);

  const std::string text = eplb::read_text_file(spec);
  if (is_placement_json(text)) {
    eplb::Placement placement = eplb::parse_placement_json(text, spec);
    FULCRUM_CHECK(placement.num_layers == num_moe_layers && placement.num_logical_experts == num_logical_experts &&
                      placement.num_physical_experts() == topology.num_physical_experts &&
                      placement.topology.num_gpus == topology.num_gpus,
                  "{}: placement is {} MoE layers x {} experts, {} slots on {} GPUs; the model and EP group need "
                  "{} x {}, {} slots on {} GPUs",
                  spec, placement.num_layers, placement.num_logical_experts, placement.num_physical_experts(),
                  placement.topology.num_gpus, num_moe_layers, num_logical_experts, topology.num_physical_experts,
                  topology.num_gpus);
    placement.topology.num_nodes = topology.num_nodes;
    placement.validate();
    return placement;
  }
  const eplb::LoadMatrix loads = eplb::read_loads_file(spec);
  FULCRUM_CHECK(loads.num_layers == num_moe_layers && loads.num_logical_experts == num_logical_experts,
                "{}: loads are {} MoE layers x {} experts, the model has {} x {}", spec, loads.num_layers,
                loads.num_logical_experts, num_moe_layers, num_logical_experts);
  const auto planner = eplb::make_planner(planner_name);
  return planner->plan(loads, eplb::PlanOptions{topology, 1, nullptr});
}

}  // namespace fulcrum::eplb_runtime
