#pragma once
// Migration-aware replanning for the fulcrum planner: given the current map of a layer and a fresh
// (from-scratch) plan for the new loads, produce a map that changes few slots of the current one.
#include <cstdint>
#include <span>

#include "eplb/fulcrum_layout.hpp"

namespace fulcrum::eplb::fulcrum_detail {

// Relabels `fresh` onto `current`: matches fresh GPUs to current GPUs maximizing the replicas they have
// in common (assignment problem, Hungarian method), then keeps every common expert in its current slot.
// Same GPU contents as `fresh` up to a permutation of GPUs, hence the same balance. Writes `out`.
void relabel_onto(std::span<const int32_t> fresh, std::span<const int32_t> current, int num_experts,
                  int num_gpus, std::span<int32_t> out);

// Starting from `current` (copied into `layout`, which must be reset for the loads): removes duplicate
// replicas on a GPU (one reassign each), runs the excess descent, then moves aimed at the heaviest GPU
// (best gain per slot changed) and the from-scratch local search if still above target_max, and the
// undo pass once at or below it. Stops early past `max_moves` changed slots. Returns the slots that
// differ from `current`; the result is in `layout`.
int descend_from(Layout& layout, std::span<const int32_t> current, double target_max, int max_moves);

// Excess descent (fulcrum_excess.cpp) on a rebuilt layout: lowers the excess over `target` (<= stop)
// until the max GPU load is <= stop; `origin` is the map moves are counted against. Aiming below the
// stop leaves headroom on the GPUs that receive load. Returns the slots that then differ from origin.
int excess_descent(Layout& layout, std::span<const int32_t> origin, double stop, double target, int max_moves);

// From `current`, changes the replica counts to `counts` with the fewest slot changes (surplus replicas
// on the most loaded GPUs freed, missing ones placed on the lightest GPUs), then runs the from-scratch
// local search down to target_max and the undo pass. Returns the slots that differ from current.
int refit_from(Layout& layout, std::span<const int32_t> current, std::span<const int> counts, double target_max);

// Restores original experts of changed slots (single slots, or pairs swapped back) while every GPU
// stays <= target_max and no duplicate appears. Returns the slots that then differ from origin.
int undo_unneeded(Layout& layout, std::span<const int32_t> origin, double target_max);

// Number of slots whose expert differs.
int slots_changed(std::span<const int32_t> a, std::span<const int32_t> b);

}  // namespace fulcrum::eplb::fulcrum_detail
