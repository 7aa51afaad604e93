#pragma once
// Expert slots across an elastic world's rebuild (server/engine_step_executor.cpp, EngineStepExecutor::rebuild):
// the new rank's slots come from what the ranks already hold, the checkpoint only for what nobody holds.
//
//   1. keep_held_experts    before the old rank goes: one host copy of each logical expert its slots hold,
//                           per MoE layer (a rank that rejoins, a fresh process, holds nothing);
//   2. gather_held          collective over the new world: which logical experts each of its ranks holds;
//   3. align_to_held        the re-planned placement's blocks of slots go to the ranks holding most of them;
//      plan_rebuild_slots   every rank computes the same plan from the new placement and that table: a slot
//                           of new EP rank d holding logical expert e is filled
//                             kLocal       from d's own held copy when d holds e,
//                             kSurvivor    else from the lowest new-world rank that holds e,
//                             kCheckpoint  else (e's every replica was on a lost rank) from the checkpoint;
//                           a second slot of d needing the same e that d does not hold is kCopy: copied on d from
//                           the first once that one is filled (e crosses the network or leaves the checkpoint once);
//   4. the new rank loads its non-expert weights and its kCheckpoint slots (InProcessRun::read_expert_slot
//      = plan.reads_from_checkpoint), then fill_rebuild_slots (collective) writes the others: local copies,
//      and survivors' slots through eplb_runtime::BackendSlotCopyExecutor (the slot migration's send / recv /
//      commit), layer by layer, sends before receives.
// The layout is elastic EP's (server/elastic_world.hpp): world rank = EP rank, one stage, whole experts.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "comm/communicator.hpp"
#include "eplb/placement.hpp"
#include "model/backend.hpp"
#include "model/qwen3_moe.hpp"

namespace fulcrum::engine {

// One process's copy of the logical experts its old rank's slots held, in host memory (a CPU backend).
struct HeldExperts {
  std::unique_ptr<model::Backend> host;
  std::vector<std::vector<int32_t>> experts;  // [num_moe_layers]: the logical experts held, ascending
  std::vector<model::ExpertSlotView> views;   // [num_moe_layers]: slot i holds experts[l][i] (bare views)

  int num_layers() const { return static_cast<int>(experts.size()); }
  // The held slot of logical expert `expert_idx` in MoE layer `moe_layer_idx`, or -1.
  int slot_of(int moe_layer_idx, int expert_idx) const;
};

// Copies one slot per distinct logical expert of `views` (the old rank's expert_slot_views(), read on
// `backend`) to host memory. `num_moe_layers` layers; a rank that held none passes no view (backend unused).
HeldExperts keep_held_experts(model::Backend* backend, std::span<const model::ExpertSlotView> views,
                              int num_moe_layers);

// Which logical experts every rank of a world holds: [rank][MoE layer][logical expert] flattened.
struct HeldTable {
  int num_ranks = 0, num_layers = 0, num_experts = 0;
  std::vector<uint8_t> held;  // [num_ranks * num_layers * num_experts]: 1 where held

  HeldTable(int num_ranks, int num_layers, int num_experts);
  bool holds(int rank, int moe_layer_idx, int expert_idx) const;
  void set(int rank, int moe_layer_idx, int expert_idx);
};

// Collective over `world`: every rank's HeldExperts as one table (the same on every rank).
HeldTable gather_held(const HeldExperts& mine, int num_experts, comm::Communicator& world);

// What the new world holds, as a placement of `topology` (one stage, EP rank = world rank, P / G slots each) for a
// migration-aware planner's `current`: each held logical expert once, on a holder with room (the one with the
// fewest so far), every expert no rank can take to the ranks with the most room, then each rank's free slots with
// the other experts it holds, then any others, cyclically. Every logical expert has a replica.
eplb::Placement held_placement(const HeldTable& held, const eplb::Topology& topology);

// `placement` with, in each MoE layer, its EP ranks' blocks of slots handed out again so that the ranks already
// hold most of their new slots' experts (greedy: the (block, rank) pair with the most such slots first, ties to
// the lowest block, then rank). A block moves whole, so every rank's load and the balance are unchanged.
eplb::Placement align_to_held(eplb::Placement placement, const HeldTable& held);

enum class SlotSource : uint8_t { kLocal, kSurvivor, kCheckpoint, kCopy };

struct SlotFill {
  SlotSource source = SlotSource::kCheckpoint;
  int src_rank = -1;    // kLocal / kCopy: the slot's own rank; kSurvivor: the new-world rank that sends it
  int expert_idx = -1;  // the logical expert of the slot
  int copy_of = -1;     // kCopy: the earlier slot (global index, same rank) with the same expert
};

struct RebuildSlotPlan {
  eplb::Topology topology;                   // the new placement's: EP rank d holds slots [d * P/G, +P/G)
  std::vector<std::vector<SlotFill>> fills;  // [num_moe_layers][num_physical_experts]
  // Over every rank of the world:
  int64_t num_local = 0, num_received = 0, num_from_checkpoint = 0, num_copied = 0;  // slots
  int64_t num_experts_from_checkpoint = 0;  // distinct (layer, logical expert) pairs no rank holds

  // Whether local slot `local_slot` of EP rank `rank` in MoE layer `moe_layer_idx` is read from the checkpoint.
  bool reads_from_checkpoint(int rank, int moe_layer_idx, int local_slot) const;
};

// The plan of step 3 for placement `to` (validated; its EP ranks are the table's ranks).
RebuildSlotPlan plan_rebuild_slots(const eplb::Placement& to, const HeldTable& held);

// Bytes this rank received and slots it wrote.
struct RebuildFillStats {
  int64_t num_local = 0, num_received = 0, num_sent = 0, num_copied = 0;
  int64_t bytes_received = 0;
};

// Collective over `world` (rank = EP rank of the plan): writes this rank's kLocal, kSurvivor and kCopy slots of
// `views` (the new rank's expert_slot_views(), on `backend`, their maps already those of the plan's placement)
// from `held`, and sends the survivors' slots other ranks need.
RebuildFillStats fill_rebuild_slots(const RebuildSlotPlan& plan, const HeldExperts& held, model::Backend& backend,
                                    std::span<const model::ExpertSlotView> views, comm::Communicator& world);

}  // namespace fulcrum::engine
