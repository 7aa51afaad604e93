#pragma once
// Planners turn a load matrix into a placement. One interface; each planner works layer by layer.
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "eplb/loads.hpp"
#include "eplb/placement.hpp"

namespace fulcrum::eplb {

struct PlanOptions {
  Topology topology;
  int num_groups = 1;                  // expert groups (DeepSeek-V3 style); Qwen3-MoE has none (1)
  const Placement* current = nullptr;  // present: migration-aware planners keep slots where they can
};

class Planner {
 public:
  virtual ~Planner() = default;
  virtual std::string_view name() const = 0;

  // One layer: expert_load [E] -> physical_to_logical_map [P] written into `out_map`.
  // `current_map` is empty unless the caller replans from an existing placement.
  virtual void plan_layer(std::span<const double> expert_load, const PlanOptions& options,
                          std::span<const int32_t> current_map, std::span<int32_t> out_map) const = 0;

  // All layers; validates inputs (topology, shapes, current placement) and the result.
  Placement plan(const LoadMatrix& loads, const PlanOptions& options) const;
};

// "fulcrum" (default) or "deepseek"; unknown names throw fulcrum::Error listing the known ones.
std::unique_ptr<Planner> make_planner(std::string_view name);

// Factories, one per planner file.
std::unique_ptr<Planner> make_fulcrum_planner();
std::unique_ptr<Planner> make_deepseek_planner();

// Names accepted by make_planner.
std::vector<std::string> planner_names();

}  // namespace fulcrum::eplb
