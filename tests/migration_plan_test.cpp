// Migration plans: every changed slot received once, from a holder of the expert, closest first.
#include <gtest/gtest.h>

#include <random>

#include "eplb/migration_plan.hpp"

namespace fulcrum::eplb {
namespace {

Placement random_placement(std::mt19937& rng, const Topology& topo, int num_layers, int num_experts) {
  Placement p(topo, num_layers, num_experts);
  for (int l = 0; l < num_layers; ++l) {
    auto map = p.layer(l);
    for (int s = 0; s < topo.num_physical_experts; ++s) map[s] = s < num_experts ? s : static_cast<int>(rng() % num_experts);
    std::shuffle(map.begin(), map.end(), rng);
  }
  p.validate();
  return p;
}

TEST(MigrationPlan, IdenticalPlacementsNeedNothing) {
  const Placement p = trivial_placement({16, 4, 2}, 3, 12);
  const MigrationPlan plan = plan_migration(p, p);
  EXPECT_EQ(plan.num_transfers(), 0);
  EXPECT_EQ(plan.max_received_per_gpu_layer, 0);
}

TEST(MigrationPlan, PrefersLocalThenSameNode) {
  // 4 GPUs x 2 slots, 2 nodes. Old: GPU0 {0,1} GPU1 {2,3} GPU2 {4,5} GPU3 {0,1}.
  Placement from({8, 4, 2}, 1, 6);
  from.physical_to_logical_map = {0, 1, 2, 3, 4, 5, 0, 1};
  Placement to = from;
  to.physical_to_logical_map = {0, 0, 1, 1, 4, 3, 2, 5};
  to.validate();
  const MigrationPlan plan = plan_migration(from, to);
  ASSERT_EQ(plan.num_transfers(), experts_moved(from, to));
  for (const auto& t : plan.transfers) {
    EXPECT_EQ(from.layer(0)[t.src_slot], t.expert_idx);
    EXPECT_EQ(to.layer(0)[t.dst_slot], t.expert_idx);
  }
  auto find = [&](int dst) {
    for (const auto& t : plan.transfers) {
      if (t.dst_slot == dst) return t;
    }
    ADD_FAILURE() << "no transfer into slot " << dst;
    return SlotTransfer{};
  };
  EXPECT_EQ(find(1).kind, TransferKind::kLocal);  // expert 0 is already on GPU0
  EXPECT_EQ(find(1).src_slot, 0);
  EXPECT_EQ(find(2).kind, TransferKind::kIntraNode);  // expert 1 from GPU0 (same node), not GPU3
  EXPECT_EQ(find(2).src_slot, 1);
  EXPECT_EQ(find(5).kind, TransferKind::kInterNode);  // expert 3 lives only on node 0
  EXPECT_EQ(find(7).kind, TransferKind::kIntraNode);  // expert 5 lives on GPU2, same node as GPU3
  EXPECT_EQ(plan.transfers.front().kind, TransferKind::kLocal);  // local copies first
}

TEST(MigrationPlan, RandomPlacementsReceiveEachChangedSlotOnce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int num_nodes = 1 + static_cast<int>(rng() % 3);
    const int num_gpus = num_nodes * (1 + static_cast<int>(rng() % 4));
    const int num_experts = 1 + static_cast<int>(rng() % 20);
    const int slots_per_gpu = (num_experts + num_gpus - 1) / num_gpus + static_cast<int>(rng() % 3);
    const Topology topo{num_gpus * slots_per_gpu, num_gpus, num_nodes};
    const Placement from = random_placement(rng, topo, 2, num_experts);
    const Placement to = random_placement(rng, topo, 2, num_experts);
    const MigrationPlan plan = plan_migration(from, to);
    ASSERT_EQ(plan.num_transfers(), experts_moved(from, to));
    std::vector<int> received(static_cast<size_t>(2) * topo.num_physical_experts, 0);
    for (const auto& t : plan.transfers) {
      ++received[static_cast<size_t>(t.layer_idx) * topo.num_physical_experts + t.dst_slot];
      ASSERT_EQ(from.layer(t.layer_idx)[t.src_slot], t.expert_idx);
      ASSERT_EQ(to.layer(t.layer_idx)[t.dst_slot], t.expert_idx);
      const bool local_exists = [&] {
        for (int s = 0; s < topo.num_physical_experts; ++s) {
          if (topo.gpu_of_slot(s) == topo.gpu_of_slot(t.dst_slot) && from.layer(t.layer_idx)[s] == t.expert_idx) return true;
        }
        return false;
      }();
      ASSERT_EQ(local_exists, t.kind == TransferKind::kLocal);
    }
    for (size_t i = 0; i < received.size(); ++i) {
      ASSERT_EQ(received[i], from.physical_to_logical_map[i] != to.physical_to_logical_map[i] ? 1 : 0);
    }
    EXPECT_EQ(plan.num_local + plan.num_intra_node + plan.num_inter_node, plan.num_transfers());
  }
}

TEST(MigrationPlan, RejectsDifferentTopologies) {
  const Placement a = trivial_placement({8, 4, 1}, 1, 8);
  const Placement b = trivial_placement({8, 2, 1}, 1, 8);
  EXPECT_THROW(plan_migration(a, b), Error);
}

}  // namespace
}  // namespace fulcrum::eplb
