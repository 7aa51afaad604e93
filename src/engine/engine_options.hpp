#pragma once
// Options of the parallel engine beside the layout, and the routing hook: the seam through which the
// EPLB runtime (recorder, rebalance manager) observes every MoE layer's routing decisions.
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "eplb/dispatch.hpp"

namespace fulcrum::engine {

// One MoE layer of one forward pass, as seen by one rank: the tokens this rank originated in the MoE
// exchange (its chunk of its attention-DP group's tokens). Summed over the tp ranks of a stage, every
// token of the pass appears exactly once.
struct RoutingRecord {
  uint64_t pass_idx = 0;     // forward passes of this engine so far (0 for the first)
  int layer_idx = 0;         // decoder layer
  int moe_layer_idx = 0;     // row of the model-wide placement
  int source = 0;            // stage tp rank that originated these tokens
  int top_k = 0;             // num_experts_per_tok
  std::span<const int32_t> expert_ids;  // [num_tokens * top_k]: each token's logical experts, ascending
  std::span<const int32_t> slot_ids;    // [num_tokens * top_k]: the physical slot that computed each entry
};

// Called on each rank's own thread (ranks run concurrently: synchronize shared state).
using RoutingHook = std::function<void(const RoutingRecord&)>;

struct EngineOptions {
  std::string moe_a2a_backend = "allgather";  // --moe-a2a-backend: allgather | alltoall
  eplb::DispatchAlgorithm dispatch_algorithm = eplb::DispatchAlgorithm::kStatic;  // --ep-dispatch-algorithm
  uint64_t dispatch_seed = 0x5eed;            // dynamic dispatch: the same on every rank
  RoutingHook on_routing;
};

}  // namespace fulcrum::engine
