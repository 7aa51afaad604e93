// A re-implementation of DeepSeek's public EPLB algorithm (github.com/deepseek-ai/EPLB, eplb.py), written
// here from its description: greedy replication (each extra slot to the expert with the highest load per
// replica), then greedy balanced packing (heaviest item into the lightest pack that has room).
// Hierarchical when num_groups % num_nodes == 0 (groups packed onto nodes first), global otherwise.
// Like the reference, loads are float32 and per-pack sums are accumulated in float32: a float64 port
// orders near-equal packs differently on at least one golden case.
#include <algorithm>
#include <numeric>
#include <queue>

#include "eplb/planner.hpp"

namespace fulcrum::eplb {
namespace {

struct Packing {
  std::vector<int> pack_idx;      // [num_items]
  std::vector<int> rank_in_pack;  // [num_items]
};

// Items (weights) into num_packs packs of equal item count; heaviest first into the lightest pack with room.
// Equal weights keep index order; equal pack sums pick the lowest pack index.
Packing balanced_packing(const std::vector<float>& weight, int num_packs) {
  const int num_items = static_cast<int>(weight.size());
  const int items_per_pack = num_items / num_packs;
  Packing packing{std::vector<int>(num_items), std::vector<int>(num_items, 0)};
  if (items_per_pack == 1) {
    std::iota(packing.pack_idx.begin(), packing.pack_idx.end(), 0);
    return packing;
  }
  std::vector<int> order(num_items);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return weight[a] > weight[b]; });
  std::vector<float> pack_weight(num_packs, 0.0f);
  std::vector<int> pack_items(num_packs, 0);
  for (int item : order) {
    int best = -1;
    for (int p = 0; p < num_packs; ++p) {
      if (pack_items[p] < items_per_pack && (best < 0 || pack_weight[p] < pack_weight[best])) best = p;
    }
    packing.pack_idx[item] = best;
    packing.rank_in_pack[item] = pack_items[best]++;
    pack_weight[best] += weight[item];
  }
  return packing;
}

// Replicates experts into num_physical slots: slot i < E holds expert i, each later slot the expert with
// the highest float32 load per replica (lowest index on ties). Returns slot -> expert and counts.
void replicate_experts(const std::vector<float>& weight, int num_physical, std::vector<int>& slot_to_expert,
                       std::vector<int>& counts) {
  const int num_experts = static_cast<int>(weight.size());
  slot_to_expert.resize(num_physical);
  std::iota(slot_to_expert.begin(), slot_to_expert.begin() + num_experts, 0);
  counts.assign(num_experts, 1);
  // Max-heap on (load per replica, then lower index first).
  auto less = [](const std::pair<float, int>& a, const std::pair<float, int>& b) {
    return a.first < b.first || (a.first == b.first && a.second > b.second);
  };
  std::priority_queue<std::pair<float, int>, std::vector<std::pair<float, int>>, decltype(less)> heap(less);
  for (int e = 0; e < num_experts; ++e) heap.emplace(weight[e], e);
  for (int slot = num_experts; slot < num_physical; ++slot) {
    const int e = heap.top().second;
    heap.pop();
    slot_to_expert[slot] = e;
    ++counts[e];
    heap.emplace(weight[e] / static_cast<float>(counts[e]), e);
  }
}

class DeepSeekPlanner final : public Planner {
 public:
  std::string_view name() const override { return "deepseek"; }

  void plan_layer(std::span<const double> expert_load, const PlanOptions& options, std::span<const int32_t>,
                  std::span<int32_t> out_map) const override {
    const Topology& topo = options.topology;
    const bool hierarchical = options.num_groups % topo.num_nodes == 0;
    plan_hierarchical(expert_load, topo.num_physical_experts, hierarchical ? options.num_groups : 1,
                      hierarchical ? topo.num_nodes : 1, topo.num_gpus, out_map);
  }

 private:
  static void plan_hierarchical(std::span<const double> expert_load, int num_physical, int num_groups, int num_nodes,
                                int num_gpus, std::span<int32_t> out_map) {
    const int num_experts = static_cast<int>(expert_load.size());
    FULCRUM_CHECK(num_experts % num_groups == 0, "--groups ({}) must divide the number of logical experts ({})",
                  num_groups, num_experts);
    FULCRUM_CHECK(num_groups % num_nodes == 0, "nodes ({}) must divide groups ({})", num_nodes, num_groups);
    FULCRUM_CHECK(num_physical % num_nodes == 0, "nodes ({}) must divide physical experts ({})", num_nodes,
                  num_physical);
    const int group_size = num_experts / num_groups;
    const int groups_per_node = num_groups / num_nodes;
    const int experts_per_node = num_experts / num_nodes;
    const int physical_per_node = num_physical / num_nodes;
    const int gpus_per_node = num_gpus / num_nodes;
    const int slots_per_gpu = num_physical / num_gpus;

    std::vector<float> weight(expert_load.begin(), expert_load.end());

    // Step 1: groups onto nodes. A group's token count is its float32 sum (computed exactly, then rounded).
    std::vector<float> group_weight(num_groups);
    for (int g = 0; g < num_groups; ++g) {
      double sum = 0.0;
      for (int j = 0; j < group_size; ++j) sum += weight[g * group_size + j];
      group_weight[g] = static_cast<float>(sum);
    }
    const Packing group_packing = balanced_packing(group_weight, num_nodes);
    // node_expert_to_logical: experts reordered so node n owns [n * experts_per_node, (n+1) * experts_per_node).
    std::vector<int> node_expert_to_logical(num_experts);
    for (int e = 0; e < num_experts; ++e) {
      const int g = e / group_size;
      const int position =
          (group_packing.pack_idx[g] * groups_per_node + group_packing.rank_in_pack[g]) * group_size + e % group_size;
      node_expert_to_logical[position] = e;
    }

    std::vector<float> node_weight(experts_per_node);
    std::vector<int> slot_to_node_expert;
    std::vector<int> counts;
    std::vector<float> replica_weight(physical_per_node);
    for (int node = 0; node < num_nodes; ++node) {
      // Step 2: replicas within the node.
      for (int j = 0; j < experts_per_node; ++j) {
        node_weight[j] = weight[node_expert_to_logical[node * experts_per_node + j]];
      }
      replicate_experts(node_weight, physical_per_node, slot_to_node_expert, counts);
      // Step 3: replicas onto the node's GPUs.
      for (int i = 0; i < physical_per_node; ++i) {
        const int j = slot_to_node_expert[i];
        replica_weight[i] = node_weight[j] / static_cast<float>(counts[j]);
      }
      const Packing gpu_packing = balanced_packing(replica_weight, gpus_per_node);
      for (int i = 0; i < physical_per_node; ++i) {
        const int slot = node * physical_per_node + gpu_packing.pack_idx[i] * slots_per_gpu + gpu_packing.rank_in_pack[i];
        out_map[slot] = node_expert_to_logical[node * experts_per_node + slot_to_node_expert[i]];
      }
    }
  }
};

}  // namespace

std::unique_ptr<Planner> make_deepseek_planner() { return std::make_unique<DeepSeekPlanner>(); }

}  // namespace fulcrum::eplb
