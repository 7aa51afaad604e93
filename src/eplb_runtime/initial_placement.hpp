#pragma once
// The placement a server starts with (--init-expert-location):
//   "trivial"                 slot s holds logical expert s % E
//   a placement JSON file     one with "physical_to_logical_map" (eplb/placement_io.hpp)
//   a loads file              CSV, or JSON with "logical_count" [L][E] / [S][L][E] (a recorder dump):
//                             planned at start-up with `planner_name` ("static EPLB")
// The result must match the model and the EP group (layers, experts, slots, ranks); a mismatch throws
// fulcrum::Error saying what differs rather than silently falling back.
#include <string>
#include <string_view>

#include "eplb/placement.hpp"

namespace fulcrum::eplb_runtime {

eplb::Placement make_initial_placement(const std::string& spec, const eplb::Topology& topology, int num_moe_layers,
                                       int num_logical_experts, std::string_view planner_name);

}  // namespace fulcrum::eplb_runtime
