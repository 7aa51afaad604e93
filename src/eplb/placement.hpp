#pragma once
// A placement: for every MoE layer, which logical expert each physical slot holds.
// physical_to_logical_map[layer][slot]; replica lists and counts are derived from it.
#include <cstdint>
#include <span>
#include <vector>

#include "eplb/topology.hpp"

namespace fulcrum::eplb {

struct Placement {
  Topology topology;
  int num_layers = 0;
  int num_logical_experts = 0;
  std::vector<int32_t> physical_to_logical_map;  // [num_layers, num_physical_experts]

  Placement() = default;
  Placement(const Topology& topo, int layers, int logical_experts)
      : topology(topo), num_layers(layers), num_logical_experts(logical_experts),
        physical_to_logical_map(static_cast<size_t>(layers) * topo.num_physical_experts, 0) {}

  int num_physical_experts() const { return topology.num_physical_experts; }

  std::span<const int32_t> layer(int layer_idx) const {
    return {physical_to_logical_map.data() + static_cast<size_t>(layer_idx) * num_physical_experts(),
            static_cast<size_t>(num_physical_experts())};
  }
  std::span<int32_t> layer(int layer_idx) {
    return {physical_to_logical_map.data() + static_cast<size_t>(layer_idx) * num_physical_experts(),
            static_cast<size_t>(num_physical_experts())};
  }

  // Checks topology, shapes, ids in range and that every logical expert has a replica in every layer.
  // Throws fulcrum::Error naming the first problem (layer, slot, expert).
  void validate() const;
};

// Replica count per logical expert of one layer's map: [num_logical_experts].
std::vector<int> replica_counts(std::span<const int32_t> layer_map, int num_logical_experts);

// Physical slots of each logical expert, ascending: [num_logical_experts][count].
std::vector<std::vector<int>> replica_slots(std::span<const int32_t> layer_map, int num_logical_experts);

// Slot s holds expert s % E: what a server runs before any plan.
Placement trivial_placement(const Topology& topo, int num_layers, int num_logical_experts);

// Number of (layer, slot) whose logical expert differs between two placements of the same shape.
int64_t experts_moved(const Placement& from, const Placement& to);

}  // namespace fulcrum::eplb
