#include "eplb/placement.hpp"

namespace fulcrum::eplb {

void Placement::validate() const {
  FULCRUM_CHECK(num_logical_experts > 0, "placement has no logical experts");
  FULCRUM_CHECK(num_layers > 0, "placement has no layers");
  topology.validate(num_logical_experts, num_layers);
  const size_t expected = static_cast<size_t>(num_layers) * num_physical_experts();
  FULCRUM_CHECK(physical_to_logical_map.size() == expected,
                "physical_to_logical_map has {} entries, expected {} layers x {} slots", physical_to_logical_map.size(),
                num_layers, num_physical_experts());
  // Per layer: every id in range, every expert seen (a layer stamp avoids clearing the table per layer).
  std::vector<int> seen_in_layer(num_logical_experts, -1);
  for (int layer_idx = 0; layer_idx < num_layers; ++layer_idx) {
    auto map = layer(layer_idx);
    int num_seen = 0;
    for (int slot_idx = 0; slot_idx < num_physical_experts(); ++slot_idx) {
      const int32_t expert_idx = map[slot_idx];
      FULCRUM_CHECK(expert_idx >= 0 && expert_idx < num_logical_experts,
                    "layer {} slot {}: logical expert {} out of range [0, {})", layer_idx, slot_idx, expert_idx,
                    num_logical_experts);
      if (seen_in_layer[expert_idx] != layer_idx) {
        seen_in_layer[expert_idx] = layer_idx;
        ++num_seen;
      }
    }
    if (num_seen < num_logical_experts) {
      for (int expert_idx = 0; expert_idx < num_logical_experts; ++expert_idx) {
        FULCRUM_CHECK(seen_in_layer[expert_idx] == layer_idx, "layer {}: logical expert {} has no replica", layer_idx,
                      expert_idx);
      }
    }
  }
}

std::vector<int> replica_counts(std::span<const int32_t> layer_map, int num_logical_experts) {
  std::vector<int> counts(num_logical_experts, 0);
  for (int32_t expert_idx : layer_map) ++counts[expert_idx];
  return counts;
}

std::vector<std::vector<int>> replica_slots(std::span<const int32_t> layer_map, int num_logical_experts) {
  std::vector<std::vector<int>> slots(num_logical_experts);
  for (size_t slot_idx = 0; slot_idx < layer_map.size(); ++slot_idx) {
    slots[layer_map[slot_idx]].push_back(static_cast<int>(slot_idx));
  }
  return slots;
}

Placement trivial_placement(const Topology& topo, int num_layers, int num_logical_experts) {
  Placement placement(topo, num_layers, num_logical_experts);
  for (int layer_idx = 0; layer_idx < num_layers; ++layer_idx) {
    auto map = placement.layer(layer_idx);
    for (int slot_idx = 0; slot_idx < topo.num_physical_experts; ++slot_idx) map[slot_idx] = slot_idx % num_logical_experts;
  }
  placement.validate();
  return placement;
}

int64_t experts_moved(const Placement& from, const Placement& to) {
  FULCRUM_CHECK(from.num_layers == to.num_layers && from.num_physical_experts() == to.num_physical_experts(),
                "placements differ in shape: {} layers x {} slots vs {} layers x {} slots", from.num_layers,
                from.num_physical_experts(), to.num_layers, to.num_physical_experts());
  int64_t moved = 0;
  for (size_t i = 0; i < from.physical_to_logical_map.size(); ++i) {
    moved += from.physical_to_logical_map[i] != to.physical_to_logical_map[i];
  }
  return moved;
}

}  // namespace fulcrum::eplb
