#pragma once
// Dispatch: at routing time, which physical replica of a logical expert a token is sent to, for one
// MoE layer's map (physical_to_logical_map of that layer). Three algorithms:
//   static   a fixed table [source GPU][logical expert] -> physical slot (local, then same node, then spread);
//   dynamic  per token, a replica drawn uniformly from a seeded RNG;
//   balanced per batch, each expert's tokens split over its replicas to minimize the max GPU load.
// Every rank must derive the same table / split from the same inputs, so all three are deterministic.
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "eplb/topology.hpp"

namespace fulcrum::eplb {

enum class DispatchAlgorithm { kStatic, kDynamic, kBalanced };

// "static" | "dynamic" | "balanced"; anything else throws fulcrum::Error listing them.
DispatchAlgorithm parse_dispatch_algorithm(std::string_view name);
std::string_view to_string(DispatchAlgorithm algorithm);

// SplitMix64: tiny, fast, and the same stream on every platform for a seed (unlike std distributions).
struct SplitMix64 {
  uint64_t state = 0;
  explicit SplitMix64(uint64_t seed) : state(seed) {}
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) by multiply-shift (bias below 2^-32 for the n used here).
  uint32_t below(uint32_t n) { return static_cast<uint32_t>(((next() >> 32) * n) >> 32); }
  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
};

// The replicas of every logical expert of one layer, in ascending slot order (validated map).
struct ReplicaIndex {
  std::vector<int32_t> offsets;  // [E + 1]: replicas of expert e are slots[offsets[e] .. offsets[e+1])
  std::vector<int32_t> slots;    // [P]

  ReplicaIndex(std::span<const int32_t> layer_map, int num_logical_experts, const Topology& topo);
  int num_replicas(int expert_idx) const { return offsets[expert_idx + 1] - offsets[expert_idx]; }
  std::span<const int32_t> of(int expert_idx) const {
    return {slots.data() + offsets[expert_idx], static_cast<size_t>(num_replicas(expert_idx))};
  }
};

// ---- static ----
struct StaticDispatchTable {
  int num_gpus = 0;
  int num_logical_experts = 0;
  std::vector<int32_t> slot_of;  // [num_gpus][num_logical_experts] -> physical slot

  int32_t slot(int src_gpu_idx, int expert_idx) const {
    return slot_of[static_cast<size_t>(src_gpu_idx) * num_logical_experts + expert_idx];
  }
};

// Per (source GPU, expert): the lowest local replica if the GPU holds one; else a replica on the same
// node, the node's source GPUs dealt round-robin over the node's replicas; else all replicas, the
// remaining source GPUs dealt round-robin (so their counts per replica differ by at most one). The
// round-robin starts at expert_idx % count so the first replica of every expert is not favoured.
StaticDispatchTable build_static_dispatch(std::span<const int32_t> layer_map, int num_logical_experts,
                                          const Topology& topo);

// ---- dynamic ----
class DynamicDispatcher {
 public:
  DynamicDispatcher(std::span<const int32_t> layer_map, int num_logical_experts, const Topology& topo,
                    uint64_t seed);
  // A replica of `expert_idx`, uniformly at random; the sequence is fixed by the seed.
  int32_t pick(int expert_idx) {
    const int n = replicas_.num_replicas(expert_idx);
    return replicas_.slots[replicas_.offsets[expert_idx] + (n == 1 ? 0 : rng_.below(n))];
  }

 private:
  ReplicaIndex replicas_;
  SplitMix64 rng_;
};

// ---- balanced ----
struct DispatchRoute {
  int32_t src_gpu_idx = 0;
  int32_t slot_idx = 0;
  int64_t num_tokens = 0;
};

struct BalancedDispatch {
  std::vector<int32_t> expert_route_offsets;  // [E + 1]: routes of expert e are [offsets[e], offsets[e+1])
  std::vector<DispatchRoute> routes;          // (source GPU, replica slot, tokens), only non-zero counts
  std::vector<int64_t> gpu_loads;             // [G]: tokens each GPU computes
  int64_t max_gpu_load = 0;
};

// The routes of each (source GPU, expert) pair, in route order: a source's tokens of an expert fill that
// pair's routes one after another (the engine's and the GPU layer's choice of slot from a split).
struct BalancedRouteTable {
  int num_experts = 0;
  std::vector<int32_t> offsets;  // [G * E + 1]: routes of (g, e) are [offsets[g * E + e], offsets[g * E + e + 1])
  std::vector<int32_t> slots;    // [routes]
  std::vector<int64_t> ends;     // [routes]: the pair's tokens up to and including this route

  // Slot of the pair's index-th token (0-based); throws when the pair's routes hold fewer tokens.
  int32_t slot(int src_gpu_idx, int expert_idx, int64_t index) const;
};
void build_balanced_route_table(const BalancedDispatch& split, int num_gpus, BalancedRouteTable& out);

// Splits a batch's tokens over replicas with the smallest possible max GPU load (exact, integer tokens):
// from the lower bound L = max(max fixed load, ceil(W/G)), a max-flow (experts -> GPUs holding them ->
// capacity L - fixed load) either routes all tokens or its min cut raises L to a proven bound, and the
// flow continues; only experts on two or more GPUs enter the flow. Each source GPU's tokens then go to its local
// replica first (all sources, before any spill), then to same-node replicas, then to the rest.
// A (source, slot) pair appears in at most one route: a pass moves on only once a share or a source is
// spent. Built once per layer map; split() reuses scratch buffers so it can run every forward pass.
class BalancedSplitter {
 public:
  BalancedSplitter(std::span<const int32_t> layer_map, int num_logical_experts, const Topology& topo);

  // tokens: [num_gpus][num_logical_experts], tokens from source GPU g routed to logical expert e (>= 0).
  void split(std::span<const int64_t> tokens, BalancedDispatch& out);

  int num_gpus() const { return num_gpus_; }
  int num_logical_experts() const { return num_experts_; }

 private:
  // Smallest max GPU load >= lower that routes every flexible token; leaves that flow in edge_residual_.
  int64_t min_max_load(int64_t lower);
  int64_t augment(int node, int64_t limit);

  int num_gpus_ = 0;
  int num_experts_ = 0;
  ReplicaIndex replicas_;
  // Distinct GPUs holding each expert: expert_gpus_[expert_gpu_offsets_[e] ..], and the slots of each such
  // (expert, GPU) pair: pair_slots_[pair_slot_offsets_[pair] ..].
  std::vector<int32_t> expert_gpu_offsets_, expert_gpus_, pair_slot_offsets_, pair_slots_;
  std::vector<int32_t> flexible_experts_;  // experts on >= 2 GPUs
  std::vector<int32_t> gpu_node_;          // node of each GPU, without a division per lookup

  // Flow network: node 0 source, 1..F flexible experts, F+1..F+G GPUs, F+G+1 sink. Edge pairs (fwd, rev).
  // Edge 2k is forward, 2k+1 its reverse; node_edges_[node_edge_offsets_[v] ..] lists the edges leaving v.
  std::vector<int32_t> node_edge_offsets_, node_edges_, edge_to_;
  std::vector<int32_t> pair_edge_;  // forward expert -> GPU edge of each flexible (expert, GPU) pair, else -1
  std::vector<int64_t> edge_cap_, edge_residual_;
  std::vector<int32_t> level_, next_edge_, bfs_queue_;

  // Scratch reused by split().
  std::vector<int64_t> expert_tokens_, fixed_load_, pair_tokens_, pair_left_, source_left_;
};

}  // namespace fulcrum::eplb
