#include "eplb/migration_plan.hpp"

#include <algorithm>

namespace fulcrum::eplb {

MigrationPlan plan_migration(const Placement& from, const Placement& to) {
  FULCRUM_CHECK(from.num_layers == to.num_layers && from.num_logical_experts == to.num_logical_experts &&
                    from.topology.num_physical_experts == to.topology.num_physical_experts &&
                    from.topology.num_gpus == to.topology.num_gpus && from.topology.num_nodes == to.topology.num_nodes,
                "placements differ in shape or topology; a migration needs the same slots, GPUs and nodes");
  const Topology& topo = from.topology;
  MigrationPlan plan;
  std::vector<int> sent(topo.num_gpus), received(topo.num_gpus);
  for (int layer_idx = 0; layer_idx < from.num_layers; ++layer_idx) {
    const auto old_map = from.layer(layer_idx);
    const auto new_map = to.layer(layer_idx);
    const auto holders = replica_slots(old_map, from.num_logical_experts);
    std::fill(sent.begin(), sent.end(), 0);
    std::fill(received.begin(), received.end(), 0);
    std::vector<SlotTransfer> layer_transfers;
    for (int dst = 0; dst < topo.num_physical_experts; ++dst) {
      const int expert_idx = new_map[dst];
      if (old_map[dst] == expert_idx) continue;
      const int dst_gpu = topo.gpu_of_slot(dst);
      // Closeness 0: same GPU, 1: same node, 2: other node; ties -> fewest sends so far, then lowest slot.
      auto rank = [&](int src) {
        const int src_gpu = topo.gpu_of_slot(src);
        const int closeness = src_gpu == dst_gpu ? 0 : (topo.node_of_gpu(src_gpu) == topo.node_of_gpu(dst_gpu) ? 1 : 2);
        return std::tuple(closeness, closeness == 0 ? 0 : sent[src_gpu], src);
      };
      const auto& candidates = holders[expert_idx];
      const int src = *std::min_element(candidates.begin(), candidates.end(),
                                        [&](int a, int b) { return rank(a) < rank(b); });
      const int closeness = std::get<0>(rank(src));
      const TransferKind kind =
          closeness == 0 ? TransferKind::kLocal : (closeness == 1 ? TransferKind::kIntraNode : TransferKind::kInterNode);
      if (kind != TransferKind::kLocal) {
        ++sent[topo.gpu_of_slot(src)];
        ++received[dst_gpu];
      }
      layer_transfers.push_back({layer_idx, dst, src, expert_idx, kind});
    }
    std::stable_sort(layer_transfers.begin(), layer_transfers.end(),
                     [](const SlotTransfer& a, const SlotTransfer& b) { return a.kind < b.kind; });
    for (const auto& t : layer_transfers) {
      plan.num_local += t.kind == TransferKind::kLocal;
      plan.num_intra_node += t.kind == TransferKind::kIntraNode;
      plan.num_inter_node += t.kind == TransferKind::kInterNode;
    }
    plan.transfers.insert(plan.transfers.end(), layer_transfers.begin(), layer_transfers.end());
    plan.max_sent_per_gpu_layer = std::max<int64_t>(plan.max_sent_per_gpu_layer, *std::max_element(sent.begin(), sent.end()));
    plan.max_received_per_gpu_layer =
        std::max<int64_t>(plan.max_received_per_gpu_layer, *std::max_element(received.begin(), received.end()));
  }
  return plan;
}

}  // namespace fulcrum::eplb
