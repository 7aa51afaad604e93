// Dispatch: algorithm names, the replica index shared by all algorithms, and dynamic dispatch.
#include "eplb/dispatch.hpp"

namespace fulcrum::eplb {

DispatchAlgorithm parse_dispatch_algorithm(std::string_view name) {
  if (name == "static") return DispatchAlgorithm::kStatic;
  if (name == "dynamic") return DispatchAlgorithm::kDynamic;
  if (name == "balanced") return DispatchAlgorithm::kBalanced;
  throw Error(fmt::format("unknown dispatch algorithm '{}' (known: static|dynamic|balanced)", name));
}

std::string_view to_string(DispatchAlgorithm algorithm) {
  switch (algorithm) {
    case DispatchAlgorithm::kStatic: return "static";
    case DispatchAlgorithm::kDynamic: return "dynamic";
    case DispatchAlgorithm::kBalanced: return "balanced";
  }
  return "unknown";
}

ReplicaIndex::ReplicaIndex(std::span<const int32_t> layer_map, int num_logical_experts, const Topology& topo) {
  topo.validate(num_logical_experts);
  FULCRUM_CHECK(static_cast<int>(layer_map.size()) == topo.num_physical_experts,
                "layer map has {} slots but the topology has {}", layer_map.size(), topo.num_physical_experts);
  offsets.assign(num_logical_experts + 1, 0);
  for (size_t slot_idx = 0; slot_idx < layer_map.size(); ++slot_idx) {
    const int expert_idx = layer_map[slot_idx];
    FULCRUM_CHECK(expert_idx >= 0 && expert_idx < num_logical_experts,
                  "slot {} holds expert {}, outside [0, {})", slot_idx, expert_idx, num_logical_experts);
    ++offsets[expert_idx + 1];
  }
  for (int e = 0; e < num_logical_experts; ++e) {
    FULCRUM_CHECK(offsets[e + 1] > 0, "logical expert {} has no replica in the layer map", e);
    offsets[e + 1] += offsets[e];
  }
  slots.resize(layer_map.size());
  std::vector<int32_t> fill(offsets.begin(), offsets.end() - 1);
  for (size_t slot_idx = 0; slot_idx < layer_map.size(); ++slot_idx) {
    slots[fill[layer_map[slot_idx]]++] = static_cast<int32_t>(slot_idx);
  }
}

DynamicDispatcher::DynamicDispatcher(std::span<const int32_t> layer_map, int num_logical_experts,
                                     const Topology& topo, uint64_t seed)
    : replicas_(layer_map, num_logical_experts, topo), rng_(seed) {}

}  // namespace fulcrum::eplb
