#pragma once
// The fulcrum planner (the default; make_planner("fulcrum") / make_fulcrum_planner() in planner.hpp)
// and the per-node views of a placement that its hierarchical mode optimizes.
//
// Plan of one layer from scratch:
//   1. replica counts by water-filling, capped at G replicas per expert (when P <= E * G);
//   2. flat (one node): replicas packed heaviest-first onto the lightest GPU with room that lacks the
//      expert, exactly P / G per GPU; hierarchical (num_nodes > 1): experts (all their replicas) packed
//      onto nodes first so node loads balance, split over nodes only when a node cannot take them, then
//      packed within each node;
//   3. local search on the heaviest GPU: swaps, then count-changing reassigns (fulcrum_search.hpp);
//      hierarchical mode searches within each node first and crosses nodes only until it is within
//      kHierarchySlack of the flat plan's maximum (falling back to the flat plan if it cannot).
// With a current map: see fulcrum_migrate.hpp and plan_layer in fulcrum_planner.cpp.
#include <cstdint>
#include <span>
#include <vector>

#include "eplb/topology.hpp"

namespace fulcrum::eplb {

// Per-node load of one layer under even splitting over replicas: [num_nodes] (the sum of its GPUs').
std::vector<double> node_loads(std::span<const double> expert_load, std::span<const int32_t> layer_map,
                               const Topology& topo);

// Mean over logical experts of the number of distinct nodes holding a replica.
double mean_nodes_per_expert(std::span<const int32_t> layer_map, int num_logical_experts, const Topology& topo);

// Largest number of replicas of one expert on one GPU (1 means no GPU holds an expert twice).
int max_replicas_on_one_gpu(std::span<const int32_t> layer_map, int num_logical_experts, const Topology& topo);

}  // namespace fulcrum::eplb
