#pragma once
// Building blocks of the fulcrum planner: replica counts, packing replicas onto GPUs, local search.
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "eplb/fulcrum_layout.hpp"

namespace fulcrum::eplb::fulcrum_detail {

// Water-filling replica counts: every expert one replica, each further slot to the expert with the
// highest load per replica (lowest index on ties) among those below `cap`. Minimizes the largest
// load per replica under the cap.
void capped_counts(std::span<const double> load, int slots, int cap, std::vector<int>& counts);

// Counts for a target max load M = item_cap: ceil(load / M) replicas per expert (within [1, cap]);
// replicas above M / 2 ("big": two cannot share a GPU) are limited to num_gpus by splitting the experts
// that cost the fewest extra slots into replicas of at most M / 2; the slots left over go to the
// lightest experts (near-empty fillers). False if the slots do not suffice.
bool fit_counts(std::span<const double> load, int slots, int cap, double item_cap, int num_gpus,
                std::vector<int>& counts);

// Both packers put `items` (one expert id per replica, each weighing load[e] / counts[e]) into the
// slots of GPUs [g0, g1), exactly slots_per_gpu per GPU, avoiding two replicas of an expert on one GPU
// where they can; they write layout.expert, slot_w and gpu_load of the range (call rebuild() after;
// `hosted` and `count` are left as they were). greedy_pack needs the items heaviest first or sorts
// them so (replicas of an expert next to each other).
// greedy_pack: heaviest first into the lightest GPU that has room and lacks the expert (LPT). GPU loads
// only grow, so it stops early and returns false once a GPU reaches `abort_at` before any duplicate had
// to be placed (the packing could then only end with a max load >= abort_at); otherwise true.
// greedy_pack sets *duplicated (if given) to whether it had to put two replicas of an expert on a GPU.
// Either packer may be given `weighted`: the items as (load[e] / counts[e], e), already heaviest first
// with ties by expert id (the order they sort into), so they need not weigh and check them again.
bool greedy_pack(Layout& layout, std::span<const int> items, std::span<const int> counts, int g0, int g1,
                 double abort_at = std::numeric_limits<double>::infinity(),
                 std::span<const std::pair<double, int>> weighted = {}, bool* duplicated = nullptr);
// differencing_pack: balanced largest differencing (fulcrum_kk.cpp); a nonzero seed perturbs the weights
// its decisions see (restarts on hard layers).
void differencing_pack(Layout& layout, std::span<const int> items, std::span<const int> counts, int g0, int g1,
                       uint32_t seed = 0, std::span<const std::pair<double, int>> weighted = {});

// After rebuild(): swaps away any duplicate a packer could not avoid, each with the closest-weight
// replica of a GPU in [g0, g1) where neither expert would then be duplicated.
void repair_duplicates(Layout& layout, int g0, int g1);

// Local search on GPUs [g0, g1): repeatedly takes the heaviest GPU h and applies the swap of one of its
// replicas with one of another GPU in the range that most lowers the pair's larger load (or the first
// swap found that brings both to `stop_max` or below: the best would only cost a full scan); if none helps,
// the best exchange of two of h's replicas for two of another GPU's; if none helps and `reassign` is
// set, one slot moved from an expert with spare replicas to another expert (changing counts) when that
// lowers h without raising any GPU to h's load. The no-duplicate rule holds throughout. Stops when h
// is at or below `stop_max`, when nothing helps, or after a safety cap of steps.
// Requires layout.rebuild() state (counts, hosted) to be current. `heaviest_first` may list every
// expert by replica weight under the current counts, heaviest first (saves a sort).
void local_search(Layout& layout, int g0, int g1, double stop_max, bool reassign,
                  std::span<const int> heaviest_first = {});

}  // namespace fulcrum::eplb::fulcrum_detail
