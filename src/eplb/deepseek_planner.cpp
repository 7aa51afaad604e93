// A re-implementation of DeepSeek's public EPLB algorithm (github.com/deepseek-ai/EPLB, eplb.py), written
// here from its description: greedy replication (each extra slot to the expert with the highest load per
// replica), then greedy balanced packing (heaviest item into the lightest pack that has room).
// Hierarchical when num_groups % num_nodes == 0 (groups packed onto nodes first), global otherwise.
// Like the reference, loads are float32 and per-pack sums are accumulated in float32: a float64 port
// orders near-equal packs differently on at least one golden case.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <numeric>

#include "eplb/planner.hpp"

namespace fulcrum::eplb {
namespace {

struct Packing {
  std::vector<int> pack_idx;      // [num_items]
  std::vector<int> rank_in_pack;  // [num_items]
};

// Orderable keys: a non-negative float's bit pattern orders like the float, so (value, index) pairs pack
// into one integer and heaps/sorts compare integers (several times faster than comparing pairs).
uint64_t key_ascending(float value, int idx) {
  return (static_cast<uint64_t>(std::bit_cast<uint32_t>(value)) << 32) | static_cast<uint32_t>(idx);
}
// Larger value first; on equal values the lower index first.
uint64_t key_descending(float value, int idx) {
  return (static_cast<uint64_t>(std::bit_cast<uint32_t>(value)) << 32) | (0xffffffffu - static_cast<uint32_t>(idx));
}
int idx_of_ascending(uint64_t key) { return static_cast<int>(key & 0xffffffffu); }
int idx_of_descending(uint64_t key) { return static_cast<int>(0xffffffffu - (key & 0xffffffffu)); }

// Items (weights) into num_packs packs of equal item count; heaviest first into the lightest pack with room.
// Equal weights keep index order; equal pack sums pick the lowest pack index.
// Scratch buffers are thread_local so that planning a layer does not allocate.
void balanced_packing(const std::vector<float>& weight, int num_packs, Packing& packing) {
  const int num_items = static_cast<int>(weight.size());
  const int items_per_pack = num_items / num_packs;
  packing.pack_idx.resize(num_items);
  packing.rank_in_pack.assign(num_items, 0);
  if (items_per_pack == 1) {
    std::iota(packing.pack_idx.begin(), packing.pack_idx.end(), 0);
    return;
  }
  thread_local std::vector<uint64_t> order, tree;
  thread_local std::vector<float> pack_weight;
  thread_local std::vector<int> pack_items;
  order.resize(num_items);
  for (int i = 0; i < num_items; ++i) order[i] = key_descending(weight[i], i);
  std::sort(order.begin(), order.end(), std::greater<>());
  // The lightest pack with room, lowest index on ties: a tournament tree of (sum, index) keys whose root is
  // the minimum; a full pack's key is the maximum. One update costs log2(packs) integer mins.
  int num_leaves = 1;
  while (num_leaves < num_packs) num_leaves *= 2;
  tree.assign(2 * static_cast<size_t>(num_leaves), UINT64_MAX);
  for (int p = 0; p < num_packs; ++p) tree[num_leaves + p] = key_ascending(0.0f, p);
  pack_weight.assign(num_packs, 0.0f);
  pack_items.assign(num_packs, 0);
  // While every pack is empty and items weigh > 0, the lightest pack with room is simply the next one.
  int num_dealt = 0;
  while (num_dealt < num_packs && weight[idx_of_descending(order[num_dealt])] > 0.0f) {
    const int item = idx_of_descending(order[num_dealt]);
    packing.pack_idx[item] = num_dealt;
    pack_items[num_dealt] = 1;
    pack_weight[num_dealt] = weight[item];
    tree[num_leaves + num_dealt] = key_ascending(pack_weight[num_dealt], num_dealt);
    ++num_dealt;
  }
  for (int i = num_leaves - 1; i >= 1; --i) tree[i] = std::min(tree[2 * i], tree[2 * i + 1]);
  for (size_t k = num_dealt; k < order.size(); ++k) {
    const int item = idx_of_descending(order[k]);
    const int best = idx_of_ascending(tree[1]);
    packing.pack_idx[item] = best;
    packing.rank_in_pack[item] = pack_items[best]++;
    pack_weight[best] += weight[item];
    int node = num_leaves + best;
    tree[node] = pack_items[best] < items_per_pack ? key_ascending(pack_weight[best], best) : UINT64_MAX;
    for (node /= 2; node >= 1; node /= 2) tree[node] = std::min(tree[2 * node], tree[2 * node + 1]);
  }
}

// Replicates experts into num_physical slots: slot i < E holds expert i, each later slot the expert with
// the highest float32 load per replica (lowest index on ties). Returns slot -> expert and counts.
void replicate_experts(const std::vector<float>& weight, int num_physical, std::vector<int>& slot_to_expert,
                       std::vector<int>& counts) {
  const int num_experts = static_cast<int>(weight.size());
  slot_to_expert.resize(num_physical);
  std::iota(slot_to_expert.begin(), slot_to_expert.begin() + num_experts, 0);
  counts.assign(num_experts, 1);
  // Tournament tree over experts whose root is the largest (load per replica, lower index first) key.
  thread_local std::vector<uint64_t> tree;
  int num_leaves = 1;
  while (num_leaves < num_experts) num_leaves *= 2;
  tree.assign(2 * static_cast<size_t>(num_leaves), 0);  // key 0 never wins: every real key has low bits set
  for (int e = 0; e < num_experts; ++e) tree[num_leaves + e] = key_descending(weight[e], e);
  for (int i = num_leaves - 1; i >= 1; --i) tree[i] = std::max(tree[2 * i], tree[2 * i + 1]);
  for (int slot = num_experts; slot < num_physical; ++slot) {
    const int e = idx_of_descending(tree[1]);
    slot_to_expert[slot] = e;
    ++counts[e];
    int node = num_leaves + e;
    tree[node] = key_descending(weight[e] / static_cast<float>(counts[e]), e);
    for (node /= 2; node >= 1; node /= 2) tree[node] = std::max(tree[2 * node], tree[2 * node + 1]);
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

    thread_local std::vector<float> weight, group_weight, node_weight, replica_weight;
    thread_local std::vector<int> node_expert_to_logical, slot_to_node_expert, counts;
    thread_local Packing group_packing, gpu_packing;
    weight.assign(expert_load.begin(), expert_load.end());

    // Step 1: groups onto nodes. A group's token count is its float32 sum (computed exactly, then rounded).
    group_weight.resize(num_groups);
    for (int g = 0; g < num_groups; ++g) {
      double sum = 0.0;
      for (int j = 0; j < group_size; ++j) sum += weight[g * group_size + j];
      group_weight[g] = static_cast<float>(sum);
    }
    balanced_packing(group_weight, num_nodes, group_packing);
    // node_expert_to_logical: experts reordered so node n owns [n * experts_per_node, (n+1) * experts_per_node).
    node_expert_to_logical.resize(num_experts);
    for (int e = 0; e < num_experts; ++e) {
      const int g = e / group_size;
      const int position =
          (group_packing.pack_idx[g] * groups_per_node + group_packing.rank_in_pack[g]) * group_size + e % group_size;
      node_expert_to_logical[position] = e;
    }

    node_weight.resize(experts_per_node);
    replica_weight.resize(physical_per_node);
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
      balanced_packing(replica_weight, gpus_per_node, gpu_packing);
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
