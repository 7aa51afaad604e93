#pragma once
// Which physical replica computes each routed token of one MoE layer, with the EPLB core's dispatch
// algorithms (src/eplb/dispatch.hpp). A "source" is the stage tp rank that originates a chunk of tokens
// (parallel_layout.hpp); its EP rank (source / M) is the source GPU of eplb's tables.
//   static    eplb::build_static_dispatch: table [source EP rank][logical expert] -> slot
//   dynamic   eplb::DynamicDispatcher seeded by (seed, pass, MoE layer, source): a fixed draw per entry
//   balanced  eplb::BalancedSplitter on this pass's counts [source EP rank][expert]; a source's entries of
//             expert e take, in entry order, its EP rank's routes of e after those of lower sources
// Every rank that chooses for a source gets the same slots, whichever dispatch backend runs.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "eplb/dispatch.hpp"

namespace fulcrum::engine {

// The seed of dynamic dispatch's draws for one (seed, pass, MoE layer, source): the same draws wherever this
// source's choice is made (every rank, the GPU MoE layer's reference).
uint64_t dynamic_dispatch_stream(uint64_t seed, uint64_t pass_idx, int moe_layer_idx, int source);

class ReplicaChooser {
 public:
  ReplicaChooser(eplb::DispatchAlgorithm algorithm, uint64_t seed, int num_sources, int sources_per_ep_rank);

  // The layer's map [P] over topo (a GPU is an EP rank); tables are rebuilt only when the map changed.
  void set_layer(int moe_layer_idx, std::span<const int32_t> layer_map, int num_logical_experts,
                 const eplb::Topology& topo);
  // Whether begin_pass needs every source's counts (only balanced does).
  bool needs_counts() const { return algorithm_ == eplb::DispatchAlgorithm::kBalanced; }
  // Starts a forward pass (same pass_idx on every rank); counts [num_sources][E] when needs_counts().
  void begin_pass(uint64_t pass_idx, std::span<const int64_t> counts);
  // Slots [n] for the entries of `source`, whose logical experts are experts [n] in entry order.
  void choose(int source, std::span<const int32_t> experts, std::span<int32_t> slots);

 private:
  eplb::DispatchAlgorithm algorithm_;
  uint64_t seed_;
  int num_sources_, sources_per_ep_rank_;
  int moe_layer_idx_ = 0, num_experts_ = 0;
  uint64_t pass_idx_ = 0;
  eplb::Topology topo_;
  std::vector<int32_t> layer_map_;  // [P]: the map the tables below were built from
  eplb::StaticDispatchTable static_table_;
  std::unique_ptr<eplb::BalancedSplitter> splitter_;
  eplb::BalancedDispatch split_;
  eplb::BalancedRouteTable route_table_;  // split_'s routes per (EP rank, expert)
  std::vector<int64_t> counts_;  // [num_sources][E] of this pass (balanced)
};

}  // namespace fulcrum::engine
