#pragma once
// Building blocks of the fulcrum planner: replica counts, packing replicas onto GPUs, local search.
#include <span>
#include <vector>

#include "eplb/fulcrum_layout.hpp"

namespace fulcrum::eplb::fulcrum_detail {

// Water-filling replica counts: every expert one replica, each further slot to the expert with the
// highest load per replica (lowest index on ties) among those below `cap`. Minimizes the largest
// load per replica under the cap.
void capped_counts(std::span<const double> load, int slots, int cap, std::vector<int>& counts);

// Packs `items` (one expert id per replica, each weighing load[e] / counts[e]) into the empty slots of
// GPUs [g0, g1) of `layout`, exactly slots_per_gpu per GPU: heaviest first into the lightest GPU that
// has room and does not hold the expert yet (longest-processing-time with a cardinality and a
// no-duplicate rule), then repairs any duplicate the greedy could not avoid by swaps.
// Expects layout.gpu_load of [g0, g1) zeroed; fills layout.expert, slot_w and gpu_load of the range.
void pack_range(Layout& layout, std::span<const int> items, std::span<const int> counts, int g0, int g1);

// Local search on GPUs [g0, g1): repeatedly takes the heaviest GPU and applies the swap of one of its
// replicas with a replica of another GPU in the range that most lowers the pair's larger load, keeping
// the no-duplicate rule. When no swap helps and `reassign` is set, moves one slot from an expert with
// spare replicas to another expert (changing counts) if that lowers the maximum. Stops when the
// heaviest GPU is at or below `stop_max`, when nothing helps, or after a safety cap of steps.
// Requires layout.rebuild() state (counts, hosted) to be current.
void local_search(Layout& layout, int g0, int g1, double stop_max, bool reassign);

}  // namespace fulcrum::eplb::fulcrum_detail
