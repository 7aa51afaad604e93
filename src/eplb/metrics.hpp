#pragma once
// Balance metrics. A replica of expert e carries load[e] / count[e] (tokens split evenly over replicas);
// a GPU's load is the sum over its slots. Balancedness = mean GPU load / max GPU load (1.0 is perfect).
#include <span>
#include <vector>

#include "eplb/loads.hpp"
#include "eplb/placement.hpp"

namespace fulcrum::eplb {

// Per-GPU load of one layer under even splitting over replicas: [num_gpus].
std::vector<double> gpu_loads(std::span<const double> expert_load, std::span<const int32_t> layer_map,
                              const Topology& topo);

// mean / max of non-negative loads; 1.0 when every load is zero.
double balancedness(std::span<const double> loads);

// Smallest achievable max load per replica when `num_physical_experts` slots are shared by the experts
// (every expert at least one replica): the water level tau of the best replication.
double replication_water_level(std::span<const double> expert_load, int num_physical_experts);

// Per-layer lower bound on the max GPU load: max(W / G, tau).
double lower_bound_max_gpu_load(std::span<const double> expert_load, const Topology& topo);

struct PlacementReport {
  std::vector<double> balancedness_per_layer;
  std::vector<double> lower_bound_per_layer;  // (W/G) / LB: the best balancedness any placement can reach
  double balancedness_mean = 1.0;
  double balancedness_min = 1.0;
  double lower_bound_balancedness_mean = 1.0;
};

PlacementReport evaluate_placement(const Placement& placement, const LoadMatrix& loads);

}  // namespace fulcrum::eplb
