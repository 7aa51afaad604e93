#include "eplb/metrics.hpp"

#include <algorithm>
#include <numeric>
#include <queue>

namespace fulcrum::eplb {

std::vector<double> gpu_loads(std::span<const double> expert_load, std::span<const int32_t> layer_map,
                              const Topology& topo) {
  const auto counts = replica_counts(layer_map, static_cast<int>(expert_load.size()));
  std::vector<double> loads(topo.num_gpus, 0.0);
  for (size_t slot_idx = 0; slot_idx < layer_map.size(); ++slot_idx) {
    const int expert_idx = layer_map[slot_idx];
    loads[topo.gpu_of_slot(static_cast<int>(slot_idx))] += expert_load[expert_idx] / counts[expert_idx];
  }
  return loads;
}

double balancedness(std::span<const double> loads) {
  if (loads.empty()) return 1.0;
  const double max_load = *std::max_element(loads.begin(), loads.end());
  if (max_load <= 0.0) return 1.0;
  const double mean = std::accumulate(loads.begin(), loads.end(), 0.0) / static_cast<double>(loads.size());
  return mean / max_load;
}

double replication_water_level(std::span<const double> expert_load, int num_physical_experts) {
  // Greedy: each extra slot goes to the expert with the highest load per replica. This is optimal for
  // minimizing the max of load/count (exchange argument), and the water level is that max.
  const int num_experts = static_cast<int>(expert_load.size());
  using Item = std::pair<double, int>;  // (load per replica, expert)
  std::vector<int> counts(num_experts, 1);
  std::priority_queue<Item> heap;
  for (int e = 0; e < num_experts; ++e) heap.emplace(expert_load[e], e);
  for (int extra = num_experts; extra < num_physical_experts; ++extra) {
    auto [per_replica, e] = heap.top();
    heap.pop();
    ++counts[e];
    heap.emplace(expert_load[e] / counts[e], e);
  }
  return heap.empty() ? 0.0 : heap.top().first;
}

double lower_bound_max_gpu_load(std::span<const double> expert_load, const Topology& topo) {
  const double total = std::accumulate(expert_load.begin(), expert_load.end(), 0.0);
  return std::max(total / topo.num_gpus, replication_water_level(expert_load, topo.num_physical_experts));
}

PlacementReport evaluate_placement(const Placement& placement, const LoadMatrix& loads) {
  FULCRUM_CHECK(loads.num_layers == placement.num_layers && loads.num_logical_experts == placement.num_logical_experts,
                "loads are {} layers x {} experts but the placement is {} layers x {} experts", loads.num_layers,
                loads.num_logical_experts, placement.num_layers, placement.num_logical_experts);
  PlacementReport report;
  const Topology& topo = placement.topology;
  for (int layer_idx = 0; layer_idx < placement.num_layers; ++layer_idx) {
    auto expert_load = loads.layer(layer_idx);
    report.balancedness_per_layer.push_back(balancedness(gpu_loads(expert_load, placement.layer(layer_idx), topo)));
    const double total = std::accumulate(expert_load.begin(), expert_load.end(), 0.0);
    const double bound = lower_bound_max_gpu_load(expert_load, topo);
    report.lower_bound_per_layer.push_back(bound > 0.0 ? (total / topo.num_gpus) / bound : 1.0);
  }
  const auto& per_layer = report.balancedness_per_layer;
  const double num = static_cast<double>(per_layer.size());
  report.balancedness_mean = std::accumulate(per_layer.begin(), per_layer.end(), 0.0) / num;
  report.balancedness_min = *std::min_element(per_layer.begin(), per_layer.end());
  report.lower_bound_balancedness_mean =
      std::accumulate(report.lower_bound_per_layer.begin(), report.lower_bound_per_layer.end(), 0.0) / num;
  return report;
}

}  // namespace fulcrum::eplb
