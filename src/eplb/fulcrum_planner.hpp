#pragma once
// The fulcrum planner (the default; make_planner("fulcrum") / make_fulcrum_planner() in planner.hpp)
// and the per-node views of a placement that its hierarchical mode optimizes.
//
// Plan of one layer from scratch:
//   1. replica counts by water-filling, capped at G replicas per expert (when P <= E * G, so that no
//      GPU needs two replicas of an expert; the packers and searches then never create one);
//   2. packing with exactly P / G replicas per GPU by balanced largest differencing (fulcrum_kk.cpp),
//      improved by a local search on the heaviest GPU (fulcrum_search.hpp): best single swap, else best
//      exchange of two replicas for two, else a count-changing reassign; LPT (DeepSeek's packing without
//      duplicates) is also tried, so the result is never worse than LPT with the same counts;
//   3. hard layers (still > 0.2% above the bound max(W/G, tau)): counts for a bisected target max M
//      (at most G replicas above M/2, spare slots splitting the small experts), and perturbed restarts;
//   4. hierarchical (num_nodes > 1): experts (all their replicas) packed onto nodes first so node loads
//      balance, split over nodes only when a node cannot take them, then packed and searched within
//      each node; a global search then crosses nodes only until it is within kHierarchySlack of the
//      flat plan's maximum (falling back to the flat plan if it cannot).
// With a current map (migration-aware replanning), three candidates, fewest changed slots wins among
// those meeting the stopping rule (migration_target in fulcrum_planner.cpp): the fresh plan relabelled
// onto the current GPUs (fulcrum_migrate.hpp), an excess descent from the current map
// (fulcrum_excess.cpp), and the fresh plan's counts reached from the current map then searched.
// Everything is deterministic (no randomness; restarts use fixed seeds of a fixed generator).
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
