#pragma once
// Trace simulator: replays a sequence of load windows through a planner and a dispatch algorithm and
// reports the balancedness a server would see.
//
// Semantics:
//  - `windows` is the trace, in time order; every window is one LoadMatrix of the same shape.
//  - Window 0 runs trivial_placement (slot s holds expert s % E), what a server runs before any plan.
//  - At every window t > 0 with t % rebalance_every == 0 the planner replans from the sum of windows
//    [t - rebalance_every, t) (what a recorder of that length holds), with the current placement as
//    PlanOptions::current; experts_moved(current, new) is recorded for that rebalance. So the placement
//    used on window t is planned only from windows before t; the window itself is never seen in advance.
//  - Window balancedness = mean over layers of balancedness (mean / max GPU load) of the GPU loads that
//    the dispatch algorithm produces on that window's loads under the current placement:
//    * batch_tokens == 0 (expected loads): each expert's load comes evenly from all G source GPUs.
//      static sends each source's share to its table replica; dynamic splits evenly over replicas;
//      balanced runs BalancedSplitter on integer tokens: load x 1e6 rounded per expert, spread over the
//      source GPUs as evenly as integers allow (the remainder to the sources starting at expert_idx % G).
//    * batch_tokens == T > 0: the window is replayed as batches_per_window batches of T tokens per layer;
//      each token draws top_k distinct experts by systematic sampling with inclusion probabilities
//      top_k * load / W (token_sampling.hpp), so a batch reproduces the window's load profile; source GPU = token index % G; GPU loads are the actual
//      token counts under the dispatch. Window value = mean over batches and layers. Token draws depend
//      only on (seed, window, layer, batch), so every dispatch algorithm sees the same tokens for a seed.
//  - balancedness_mean = mean over windows; balancedness_min = the worst window.
#include <cstdint>
#include <string>
#include <vector>

#include "eplb/dispatch.hpp"
#include "eplb/loads.hpp"
#include "eplb/topology.hpp"

namespace fulcrum::eplb {

struct SimulateOptions {
  Topology topology;
  int num_groups = 1;
  int rebalance_every = 1;  // windows between rebalances (and the recorder's length in windows)
  std::string algorithm = "fulcrum";  // planner name for make_planner
  DispatchAlgorithm dispatch = DispatchAlgorithm::kStatic;
  int64_t batch_tokens = 0;  // 0: expected loads; > 0: sampled batches of this many tokens
  int batches_per_window = 4;
  int top_k = 8;
  uint64_t seed = 0;
};

struct SimulateResult {
  std::vector<double> balancedness_per_window;
  double balancedness_mean = 1.0;
  double balancedness_min = 1.0;
  std::vector<int> rebalance_windows;   // windows at whose start a rebalance happened
  std::vector<int64_t> experts_moved;   // per rebalance, (layer, slot) pairs whose expert changed
};

// Throws fulcrum::Error on invalid options or windows (empty trace, shape mismatch, bad cadence, ...).
SimulateResult simulate(const std::vector<LoadMatrix>& windows, const SimulateOptions& options);

}  // namespace fulcrum::eplb
