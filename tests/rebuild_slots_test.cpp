// An elastic rebuild's expert slots (engine/rebuild_slots.hpp): the plan's choice of source for every slot of
// the new placement (a rank's own copy, else the lowest survivor holding the expert, else the checkpoint), then
// the fill over in-process ranks with synthetic slots whose values encode (MoE layer, logical expert, element),
// so each new slot is checked exactly, after a lost rank and after a rejoin.
#include <gtest/gtest.h>

#include <mutex>

#include "backend/cpu/cpu_backend.hpp"
#include "comm/in_process_communicator.hpp"
#include "engine/rebuild_slots.hpp"
#include "eplb/error.hpp"
#include "eplb_runtime/slot_copy_executor.hpp"
#include "eplb_runtime_test_util.hpp"

namespace fulcrum::engine {
namespace {

using eplb_runtime::test::make_rank_slots;
using eplb_runtime::test::RankSlots;
using eplb_runtime::test::slot_holds;
using eplb_runtime::test::slot_bytes_of_synthetic;

eplb::Placement placement_of(int num_ranks, const std::vector<std::vector<int32_t>>& rows, int num_experts) {
  eplb::Placement p(eplb::Topology{static_cast<int>(rows.at(0).size()), num_ranks, 1}, static_cast<int>(rows.size()),
                    num_experts);
  for (size_t l = 0; l < rows.size(); ++l) std::copy(rows[l].begin(), rows[l].end(), p.layer(static_cast<int>(l)).begin());
  p.validate();
  return p;
}

// Which experts each rank of `from` holds, as the new world's table: new rank r was old rank old_rank_of[r]
// (-1: a rank that rejoined, holding nothing).
HeldTable table_of(const eplb::Placement& from, const std::vector<int>& old_rank_of) {
  HeldTable table(static_cast<int>(old_rank_of.size()), from.num_layers, from.num_logical_experts);
  const int per_rank = from.topology.slots_per_gpu();
  for (size_t r = 0; r < old_rank_of.size(); ++r) {
    if (old_rank_of[r] < 0) continue;
    for (int l = 0; l < from.num_layers; ++l) {
      for (int s = 0; s < per_rank; ++s) table.set(static_cast<int>(r), l, from.layer(l)[old_rank_of[r] * per_rank + s]);
    }
  }
  return table;
}

constexpr SlotSource kLocal = SlotSource::kLocal, kSurvivor = SlotSource::kSurvivor, kCheckpoint = SlotSource::kCheckpoint,
                     kCopy = SlotSource::kCopy;

TEST(RebuildSlots, ThePlanTakesTheRanksOwnCopyThenTheLowestSurvivorThenTheCheckpoint) {
  // 8 experts over 4 ranks of 3 slots. Layer 0: rank 2 alone holds 4 and 5; layer 1: rank 2 alone holds 6.
  const eplb::Placement from = placement_of(
      4, {{0, 1, 6, 2, 3, 1, 4, 5, 6, 6, 7, 0}, {0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 7, 3}}, 8);
  // Rank 2 lost: the new ranks 0, 1, 2 were 0, 1, 3.
  const HeldTable held = table_of(from, {0, 1, 3});
  EXPECT_TRUE(held.holds(2, 1, 0));
  EXPECT_FALSE(held.holds(2, 1, 6));
  const eplb::Placement to = placement_of(3, {{0, 4, 7, 2, 3, 5, 6, 1, 4}, {6, 0, 1, 0, 2, 3, 4, 5, 7}}, 8);
  const RebuildSlotPlan plan = plan_rebuild_slots(to, held);
  ASSERT_EQ(plan.fills.size(), 2u);
  const auto expect = [&](int l, std::vector<std::pair<SlotSource, int>> want) {
    ASSERT_EQ(plan.fills[l].size(), want.size());
    for (size_t s = 0; s < want.size(); ++s) {
      EXPECT_EQ(plan.fills[l][s].source, want[s].first) << "layer " << l << " slot " << s;
      EXPECT_EQ(plan.fills[l][s].src_rank, want[s].second) << "layer " << l << " slot " << s;
      EXPECT_EQ(plan.fills[l][s].expert_idx, to.layer(l)[s]) << "layer " << l << " slot " << s;
    }
  };
  // Layer 0, new ranks holding {0, 1, 6}, {1, 2, 3}, {0, 6, 7}: expert 1 from rank 0 (the lowest of 0 and 1).
  expect(0, {{kLocal, 0}, {kCheckpoint, -1}, {kSurvivor, 2}, {kLocal, 1}, {kLocal, 1}, {kCheckpoint, -1},
             {kLocal, 2}, {kSurvivor, 0}, {kCheckpoint, -1}});
  // Layer 1, holding {0, 1, 2}, {3, 4, 5}, {0, 3, 7}: expert 0 for rank 1 from rank 0 (the lowest of 0 and 2).
  expect(1, {{kCheckpoint, -1}, {kLocal, 0}, {kLocal, 0}, {kSurvivor, 0}, {kSurvivor, 0}, {kLocal, 1},
             {kSurvivor, 1}, {kSurvivor, 1}, {kLocal, 2}});
  EXPECT_EQ(plan.num_local, 8);
  EXPECT_EQ(plan.num_received, 6);
  EXPECT_EQ(plan.num_from_checkpoint, 4);
  EXPECT_EQ(plan.num_experts_from_checkpoint, 3);  // layer 0: 4, 5; layer 1: 6
  EXPECT_TRUE(plan.reads_from_checkpoint(0, 0, 1));
  EXPECT_FALSE(plan.reads_from_checkpoint(2, 0, 0));
  EXPECT_TRUE(plan.reads_from_checkpoint(0, 1, 0));
  EXPECT_FALSE(plan.reads_from_checkpoint(2, 1, 0));

  EXPECT_THROW(plan_rebuild_slots(to, table_of(from, {0, 1, 2, 3})), Error);  // 4 ranks for a placement of 3
}

TEST(RebuildSlots, ARankThatRejoinedReceivesEverySlotAndNoneIsReadFromTheCheckpoint) {
  const eplb::Placement from = placement_of(3, {{0, 1, 2, 3, 4, 5, 6, 7, 0}}, 8);
  const HeldTable held = table_of(from, {0, 1, -1, 2});  // new rank 2 is the newcomer
  const RebuildSlotPlan plan = plan_rebuild_slots(placement_of(4, {{0, 1, 2, 3, 4, 5, 6, 7}}, 8), held);
  EXPECT_EQ(plan.num_from_checkpoint, 0);
  EXPECT_EQ(plan.num_received, 3);  // the newcomer's 4 and 5 from rank 1; rank 1's 2 from rank 0
  EXPECT_EQ(plan.fills[0][4].source, kSurvivor);
  EXPECT_EQ(plan.fills[0][4].src_rank, 1);
  EXPECT_EQ(plan.fills[0][5].src_rank, 1);
  EXPECT_EQ(plan.fills[0][2].source, kSurvivor);
  EXPECT_EQ(plan.fills[0][2].src_rank, 0);
  EXPECT_EQ(plan.fills[0][6].source, kLocal);  // expert 6: old rank 2, now rank 3
  EXPECT_EQ(plan.fills[0][6].src_rank, 3);
}

TEST(RebuildSlots, ThePlacementsBlocksGoToTheRanksHoldingTheirExperts) {
  // Old ranks held {0, 1}, {2, 3}, {4, 5}, {6, 7}; old rank 3 lost, new rank 1 rejoining (holds nothing), new
  // rank 3 was old rank 1.
  const eplb::Placement from = placement_of(4, {{0, 1, 2, 3, 4, 5, 6, 7}, {0, 1, 2, 3, 4, 5, 6, 7}}, 8);
  const HeldTable held = table_of(from, {0, -1, 2, 1});
  // Layer 0 planned as blocks [4, 5] [6, 7] [2, 3] [0, 1]; layer 1 already aligned.
  const eplb::Placement planned = placement_of(4, {{4, 5, 6, 7, 2, 3, 0, 1}, {0, 1, 6, 7, 4, 5, 2, 3}}, 8);
  const eplb::Placement aligned = align_to_held(planned, held);
  // Layer 0: [4, 5] -> rank 2 (2 held), [2, 3] -> rank 3 (2), [0, 1] -> rank 0 (2), [6, 7] -> rank 1 (what is left).
  const std::vector<int32_t> want0 = {0, 1, 6, 7, 4, 5, 2, 3};
  EXPECT_EQ(std::vector<int32_t>(aligned.layer(0).begin(), aligned.layer(0).end()), want0);
  EXPECT_EQ(std::vector<int32_t>(aligned.layer(1).begin(), aligned.layer(1).end()), want0);
  EXPECT_EQ(plan_rebuild_slots(aligned, held).num_local, 2 * 6);
  EXPECT_LT(plan_rebuild_slots(planned, held).num_local, 2 * 6);
}

TEST(RebuildSlots, AnExpertARankNeedsTwiceIsFetchedOnceAndCopied) {
  // 4 experts over 2 ranks of 3 slots; rank 1 lost. The survivor's 6 slots need expert 0 (held) twice, expert 2
  // (rank 1's only) twice: 0 comes from its copy both times, 2 is read from the checkpoint once and copied.
  const eplb::Placement from = placement_of(2, {{0, 1, 0, 2, 3, 2}}, 4);
  const HeldTable held = table_of(from, {0});
  const RebuildSlotPlan plan = plan_rebuild_slots(placement_of(1, {{0, 2, 1, 2, 3, 0}}, 4), held);
  const std::vector<SlotSource> want = {kLocal, kCheckpoint, kLocal, kCopy, kCheckpoint, kLocal};
  for (size_t s = 0; s < want.size(); ++s) EXPECT_EQ(plan.fills[0][s].source, want[s]) << "slot " << s;
  EXPECT_EQ(plan.fills[0][3].copy_of, 1);
  EXPECT_EQ(plan.fills[0][3].src_rank, 0);
  EXPECT_EQ(plan.num_from_checkpoint, 2);  // 2 once, 3 once
  EXPECT_EQ(plan.num_copied, 1);
  EXPECT_EQ(plan.num_experts_from_checkpoint, 2);
  EXPECT_FALSE(plan.reads_from_checkpoint(0, 0, 3));
}

struct RankOutcome {
  RebuildFillStats stats;
  bool every_slot_right = false;
};

// The fill on in-process ranks: new rank r held old rank old_rank_of[r]'s slots of `from` (-1: none); the new
// slots of `to` start zeroed except those the plan reads from the "checkpoint" (written here, as load_weights
// would), then fill_rebuild_slots writes the others. Returns the plan and each rank's outcome.
std::pair<RebuildSlotPlan, std::vector<RankOutcome>> rebuild(const eplb::Placement& from,
                                                             const std::vector<int>& old_rank_of,
                                                             const eplb::Placement& to) {
  const int n = static_cast<int>(old_rank_of.size());
  std::vector<int> layers(static_cast<size_t>(to.num_layers));
  for (int l = 0; l < to.num_layers; ++l) layers[l] = l;
  std::vector<RankOutcome> outcomes(static_cast<size_t>(n));
  RebuildSlotPlan plan0;
  std::mutex mutex;
  comm::run_in_process(n, [&](int rank, comm::Communicator& world) {
    backend::CpuBackend old_backend, backend;
    RankSlots old;
    if (old_rank_of[rank] >= 0) old = make_rank_slots(old_backend, from, old_rank_of[rank], layers);
    const HeldExperts held = keep_held_experts(old_rank_of[rank] >= 0 ? &old_backend : nullptr, old.views, to.num_layers);
    old = RankSlots{};  // the old rank goes before the new one is filled
    const RebuildSlotPlan plan = plan_rebuild_slots(to, gather_held(held, to.num_logical_experts, world));
    RankSlots fresh = make_rank_slots(backend, to, rank, layers);
    const int per_rank = to.topology.slots_per_gpu();
    for (model::ExpertSlotView& view : fresh.views) {
      view.slot_begin = rank * per_rank;
      for (int s = 0; s < per_rank; ++s) {
        if (plan.reads_from_checkpoint(rank, view.moe_layer_idx, s)) continue;
        backend.upload(view.gate_up.index(s), std::vector<float>(static_cast<size_t>(view.gate_up.row_numel()), 0.0f));
        backend.upload(view.down.index(s), std::vector<float>(static_cast<size_t>(view.down.row_numel()), 0.0f));
      }
    }
    RankOutcome outcome{.stats = fill_rebuild_slots(plan, held, backend, fresh.views, world)};
    outcome.every_slot_right = true;
    for (const model::ExpertSlotView& view : fresh.views) {
      for (int s = 0; s < per_rank; ++s) {
        outcome.every_slot_right = outcome.every_slot_right && slot_holds(backend, view, s, view.physical_to_logical[s]);
      }
    }
    std::lock_guard lock(mutex);
    outcomes[static_cast<size_t>(rank)] = outcome;
    if (rank == 0) plan0 = plan;
  });
  return {plan0, outcomes};
}

TEST(RebuildSlots, AfterALostRankEverySlotHoldsItsExpert) {
  // 16 experts, 2 layers, 4 ranks of 5 slots (4 redundant); rank 1 lost.
  const eplb::Placement from = placement_of(
      4, {{0, 1, 2, 3, 12, 4, 5, 6, 7, 13, 8, 9, 10, 11, 14, 12, 13, 14, 15, 0},
          {15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 6, 7, 8, 9}},
      16);
  const eplb::Placement to = placement_of(
      3, {{7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8, 0, 4},
          {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 10, 11}},
      16);
  const auto [plan, outcomes] = rebuild(from, {0, 2, 3}, to);
  int64_t local = 0, received = 0, sent = 0, bytes = 0;
  for (size_t r = 0; r < outcomes.size(); ++r) {
    EXPECT_TRUE(outcomes[r].every_slot_right) << "rank " << r;
    local += outcomes[r].stats.num_local;
    received += outcomes[r].stats.num_received;
    sent += outcomes[r].stats.num_sent;
    bytes += outcomes[r].stats.bytes_received;
  }
  EXPECT_EQ(local, plan.num_local);
  EXPECT_EQ(received, plan.num_received);
  EXPECT_EQ(sent, plan.num_received);
  EXPECT_EQ(bytes, plan.num_received * slot_bytes_of_synthetic());
  EXPECT_EQ(plan.num_local + plan.num_received + plan.num_copied + plan.num_from_checkpoint, 2 * 18);
  // Rank 1 alone held 4, 5, 6, 7 in layer 0 (13 is also on rank 3) and 10 in layer 1 (6..9 are on rank 3).
  EXPECT_EQ(plan.num_experts_from_checkpoint, 5);
  EXPECT_EQ(plan.num_from_checkpoint, 7);  // 4 twice in layer 0, 10 twice in layer 1
  EXPECT_GT(plan.num_received, 0);
}

TEST(RebuildSlots, ASlotNeededTwiceIsReceivedOnceAndCopiedOnTheRank) {
  // 8 experts; a world of 2 (4 slots each) grows to 3: the newcomer (new rank 1) needs expert 5 twice and 6 twice.
  const eplb::Placement from = placement_of(2, {{0, 1, 2, 3, 4, 5, 6, 7}}, 8);
  const eplb::Placement to = placement_of(3, {{0, 1, 2, 3, 5, 6, 5, 6, 4, 7, 0, 1}}, 8);
  const auto [plan, outcomes] = rebuild(from, {0, -1, 1}, to);
  int64_t received = 0, copied = 0;
  for (size_t r = 0; r < outcomes.size(); ++r) {
    EXPECT_TRUE(outcomes[r].every_slot_right) << "rank " << r;
    received += outcomes[r].stats.num_received;
    copied += outcomes[r].stats.num_copied;
  }
  EXPECT_EQ(plan.num_received, 4);  // 5 and 6 once each to rank 1; 0 and 1 once each to rank 2
  EXPECT_EQ(plan.num_copied, 2);
  EXPECT_EQ(received, plan.num_received);
  EXPECT_EQ(copied, plan.num_copied);
  EXPECT_EQ(plan.num_from_checkpoint, 0);
}

TEST(RebuildSlots, AfterARejoinTheNewcomerReceivesItsSlots) {
  // A world of 3 (9 slots, expert 0 twice) grows back to 4 (8 slots); new rank 2 rejoined.
  const eplb::Placement from = placement_of(3, {{0, 1, 2, 3, 4, 5, 6, 7, 0}, {7, 6, 5, 4, 3, 2, 1, 0, 3}}, 8);
  const eplb::Placement to = placement_of(4, {{0, 1, 2, 3, 4, 5, 6, 7}, {0, 1, 2, 3, 4, 5, 6, 7}}, 8);
  const auto [plan, outcomes] = rebuild(from, {0, 1, -1, 2}, to);
  for (size_t r = 0; r < outcomes.size(); ++r) EXPECT_TRUE(outcomes[r].every_slot_right) << "rank " << r;
  EXPECT_EQ(plan.num_from_checkpoint, 0);
  EXPECT_EQ(outcomes[2].stats.num_received, 4);  // its 2 slots in each layer
  EXPECT_EQ(outcomes[2].stats.num_local, 0);
  EXPECT_EQ(outcomes[2].stats.num_sent, 0);
}

}  // namespace
}  // namespace fulcrum::engine
