// Static dispatch table: a fixed replica per (source GPU, logical expert); see dispatch.hpp for the rule.
#include "eplb/dispatch.hpp"

namespace fulcrum::eplb {

StaticDispatchTable build_static_dispatch(std::span<const int32_t> layer_map, int num_logical_experts,
                                          const Topology& topo) {
  const ReplicaIndex replicas(layer_map, num_logical_experts, topo);
  StaticDispatchTable table;
  table.num_gpus = topo.num_gpus;
  table.num_logical_experts = num_logical_experts;
  table.slot_of.assign(static_cast<size_t>(topo.num_gpus) * num_logical_experts, -1);
  // Per expert: the lowest replica on each GPU and the replicas on each node, then one pass over GPUs.
  std::vector<int32_t> local_slot(topo.num_gpus), dealt_per_node(topo.num_nodes);
  std::vector<std::vector<int32_t>> node_slots(topo.num_nodes);
  for (int expert_idx = 0; expert_idx < num_logical_experts; ++expert_idx) {
    const auto slots = replicas.of(expert_idx);
    const int num_replicas = static_cast<int>(slots.size());
    std::fill(local_slot.begin(), local_slot.end(), -1);
    std::fill(dealt_per_node.begin(), dealt_per_node.end(), 0);
    for (auto& list : node_slots) list.clear();
    for (auto it = slots.rbegin(); it != slots.rend(); ++it) local_slot[topo.gpu_of_slot(*it)] = *it;  // lowest wins
    for (int32_t slot : slots) node_slots[topo.node_of_slot(slot)].push_back(slot);
    int dealt_remote = 0;  // source GPUs so far sent off-node
    for (int gpu_idx = 0; gpu_idx < topo.num_gpus; ++gpu_idx) {
      int32_t chosen = local_slot[gpu_idx];
      if (chosen < 0) {
        const int node_idx = topo.node_of_gpu(gpu_idx);
        const auto& near = node_slots[node_idx];
        if (!near.empty()) {
          chosen = near[(expert_idx + dealt_per_node[node_idx]++) % static_cast<int>(near.size())];
        } else {
          chosen = slots[(expert_idx + dealt_remote++) % num_replicas];
        }
      }
      table.slot_of[static_cast<size_t>(gpu_idx) * num_logical_experts + expert_idx] = chosen;
    }
  }
  return table;
}

}  // namespace fulcrum::eplb
