#pragma once
// Placement files (JSON), as other servers' `--init-expert-location` reads them:
//   physical_to_logical_map [L][P], num_gpus, num_nodes, num_logical_experts, logical_count [L][E].
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "eplb/loads.hpp"
#include "eplb/placement.hpp"

namespace fulcrum::eplb {

// The JSON object of a placement; `loads` (when given) is written as logical_count.
nlohmann::json placement_to_json(const Placement& placement, const LoadMatrix* loads);

// Parses and validates a placement; `origin` names the source in errors. num_gpus defaults to 1 and
// num_nodes to 1; the number of logical experts comes from num_logical_experts, else logical_count's
// width, else the largest id + 1.
Placement parse_placement_json(const std::string& text, const std::string& origin);
Placement read_placement_file(const std::string& path);

// Writes atomically (temporary file, then rename).
void write_placement_file(const std::string& path, const Placement& placement, const LoadMatrix* loads);

}  // namespace fulcrum::eplb
