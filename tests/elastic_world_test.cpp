// Elastic EP's pieces (server/elastic_world.hpp, the mesh's epochs): the new world message, where the lost
// KV groups go, the survivors' slots and placement, the layout rule, and a recovery over real sockets (an
// abort ends waits on live peers, the roll call, the next epoch's world).
#include <algorithm>
#include <atomic>
#include <iostream>
#include <functional>
#include <thread>

#include <gtest/gtest.h>

#include "comm/tcp_communicator.hpp"
#include "comm/tcp_socket.hpp"
#include "eplb/error.hpp"
#include "engine/rebuild_slots.hpp"
#include "server/elastic_world.hpp"

namespace fulcrum::server {
namespace {

TEST(ElasticWorld, TheNewWorldMessageRoundTrips) {
  const NewWorld world{.epoch = 3, .members = {0, 2, 3}, .group_hosts = {0, 0, 2, 3}, .num_physical_experts = 129};
  EXPECT_EQ(decode_new_world(encode(world)), world);
  std::vector<std::byte> bytes = encode(world);
  bytes.pop_back();
  EXPECT_THROW(decode_new_world(bytes), Error);
}

TEST(ElasticWorld, LostGroupsMoveToTheLeastLoadedSurvivor) {
  EXPECT_EQ(rehome_groups({0, 1, 2, 3}, {0, 1, 3}), (std::vector<int>{0, 1, 0, 3}));
  // Then rank 1 goes too: rank 0 hosts two groups already, rank 3 one.
  EXPECT_EQ(rehome_groups({0, 1, 0, 3}, {0, 3}), (std::vector<int>{0, 3, 0, 3}));
  EXPECT_EQ(rehome_groups({0, 1, 2, 3}, {0}), (std::vector<int>{0, 0, 0, 0}));
}

TEST(ElasticWorld, ARejoinedRankTakesItsGroupBack) {
  EXPECT_EQ(rehome_groups({0, 1, 0, 3}, {0, 1, 2, 3}), (std::vector<int>{0, 1, 2, 3}));
  // Ranks 1 and 2 were lost (their groups on 3 and 0), rank 2 comes back: group 1 stays on rank 3.
  EXPECT_EQ(rehome_groups({0, 3, 0, 3}, {0, 2, 3}), (std::vector<int>{0, 3, 2, 3}));
  // Grown back to 4 ranks, the launch layout's 32 slots each (not the 43 of the world of 3).
  EXPECT_EQ(surviving_physical_experts(128, 32, 4), 128);
  EXPECT_EQ(surviving_physical_experts(128, 33, 4), 132);
}

TEST(ElasticWorld, SurvivorsHoldEveryExpertAtLeastOnce) {
  EXPECT_EQ(surviving_physical_experts(128, 32, 3), 129);  // 43 slots each
  EXPECT_EQ(surviving_physical_experts(128, 32, 2), 128);
  EXPECT_EQ(surviving_physical_experts(8, 4, 3), 12);      // as many per rank as before
  const engine::ParallelFlags flags = surviving_flags({.tp = 4, .dp = 4, .ep = 4, .enable_dp_attention = true}, 128, 129, 3);
  EXPECT_EQ(flags.tp, 3);
  EXPECT_EQ(flags.dp, 3);
  EXPECT_EQ(flags.ep, 3);
  EXPECT_EQ(flags.num_redundant_experts, 1);

  // Expert 5 is hot: it gets the one spare slot; every expert keeps a replica.
  eplb::LoadMatrix loads(2, 128);
  for (int l = 0; l < 2; ++l) loads.values[static_cast<size_t>(l) * 128 + 5] = 1000;
  const eplb::Placement placement = replan_placement(loads, 129, 3);
  EXPECT_EQ(placement.topology.num_gpus, 3);
  for (int l = 0; l < 2; ++l) {
    const std::vector<int> counts = eplb::replica_counts(placement.layer(l), 128);
    for (int e = 0; e < 128; ++e) EXPECT_EQ(counts[static_cast<size_t>(e)], e == 5 ? 2 : 1) << "layer " << l << " expert " << e;
  }
}

// Rank 2 of 4 lost (128 experts, 32 a rank, trivial placement, skewed loads): planned from what the survivors
// hold (engine::held_placement as the migration-aware planner's current placement), the rebuild receives fewer
// slots than a plan from the loads alone, with the same balance bound kept (every expert a replica, the spare slot
// to the hot expert), and reads only the lost experts from the checkpoint.
TEST(ElasticWorld, ARebuildPlannedFromWhatSurvivorsHoldMovesFewerSlots) {
  constexpr int kExperts = 128, kLayers = 2;
  engine::HeldTable held(3, kLayers, kExperts);  // new ranks 0, 1, 2 were 0, 1, 3
  const int old_rank_of[] = {0, 1, 3};
  for (int r = 0; r < 3; ++r) {
    for (int l = 0; l < kLayers; ++l) {
      for (int e = 32 * old_rank_of[r]; e < 32 * (old_rank_of[r] + 1); ++e) held.set(r, l, e);
    }
  }
  eplb::LoadMatrix loads(kLayers, kExperts);
  for (size_t i = 0; i < loads.values.size(); ++i) loads.values[i] = 10.0 + static_cast<double>((i * 37) % 11);
  for (int l = 0; l < kLayers; ++l) loads.values[static_cast<size_t>(l) * kExperts + 5] = 1000;
  const eplb::Topology topology{129, 3, 1};
  const eplb::Placement current = engine::held_placement(held, topology);
  for (int r = 0; r < 3; ++r) {  // each rank's 32 experts in its block of 43
    int mine = 0;
    for (int s = 0; s < 43; ++s) mine += held.holds(r, 0, current.layer(0)[r * 43 + s]);
    EXPECT_EQ(mine, 32) << "rank " << r;
  }
  const engine::RebuildSlotPlan blind = engine::plan_rebuild_slots(replan_placement(loads, 129, 3), held);
  const eplb::Placement aware_placement = replan_placement(loads, 129, 3, &current);
  const engine::RebuildSlotPlan aware = engine::plan_rebuild_slots(aware_placement, held);
  std::cout << "[ elastic ] rebuild of 2 layers after a loss of 1 of 4: received " << blind.num_received
            << " slots planned from the loads alone, " << aware.num_received << " planned from what survivors hold\n";
  EXPECT_LT(aware.num_received, blind.num_received);
  EXPECT_EQ(aware.num_experts_from_checkpoint, kLayers * 32);
  for (int l = 0; l < kLayers; ++l) {
    const std::vector<int> counts = eplb::replica_counts(aware_placement.layer(l), kExperts);
    EXPECT_EQ(*std::min_element(counts.begin(), counts.end()), 1) << "layer " << l;
    EXPECT_EQ(counts[5], 2) << "layer " << l << ": the spare slot to the hot expert";
  }
}

// 2 MoE layers, 6 experts on 3 EP ranks of 3 slots. Layer 0: experts 0, 1 on ranks 0 and 2, 5 on ranks 1 and 2,
// 2 on rank 0 only, 3 and 4 on rank 1 only. Layer 1: 0, 1, 2 on ranks 0 and 2, 3, 4, 5 on rank 1 only.
TEST(ElasticWorld, LastReplicasLostAreTheExpertsWithNoSurvivingSlot) {
  eplb::Placement placement({9, 3, 1}, 2, 6);
  placement.physical_to_logical_map = {0, 1, 2, /**/ 3, 4, 5, /**/ 0, 5, 1,   // layer 0: rank 0 | rank 1 | rank 2
                                       0, 1, 2, /**/ 5, 3, 4, /**/ 0, 1, 2};  // layer 1
  EXPECT_EQ(experts_without_surviving_replica(placement, {true, false, true}), (std::vector<int>{2, 3}));
  EXPECT_EQ(experts_without_surviving_replica(placement, {false, true, true}), (std::vector<int>{1, 0}));
  EXPECT_EQ(experts_without_surviving_replica(placement, {true, true, true}), (std::vector<int>{0, 0}));
  EXPECT_EQ(experts_without_surviving_replica(placement, {false, false, true}), (std::vector<int>{3, 3}));
  EXPECT_THROW(experts_without_surviving_replica(placement, {true, false}), Error);
}

TEST(ElasticWorld, OnlyOneRankPerGroupAndEpRank) {
  const engine::ParallelFlags good{.tp = 4, .dp = 4, .ep = 4, .enable_dp_attention = true};
  EXPECT_EQ(why_elastic_ep_cannot_run(good, "cpu"), "");
  EXPECT_NE(why_elastic_ep_cannot_run(good, "cuda").find("--device cpu"), std::string::npos);
  for (const engine::ParallelFlags& bad : {engine::ParallelFlags{.tp = 4, .dp = 2, .ep = 4, .enable_dp_attention = true},
                                           engine::ParallelFlags{.tp = 4, .ep = 4},
                                           engine::ParallelFlags{.tp = 4, .dp = 4, .ep = 2, .enable_dp_attention = true},
                                           engine::ParallelFlags{.tp = 1, .dp = 1, .ep = 1}}) {
    EXPECT_NE(why_elastic_ep_cannot_run(bad, "cpu").find("--dp = --tp = --ep >= 2"), std::string::npos);
  }
}

// Three ranks on threads: ranks 1 and 2 wait on each other (both alive); rank 0's roll call aborts both waits,
// every rank answers, and the next epoch's world over the same sockets works.
TEST(ElasticWorld, AnAbortEndsWaitsOnLivePeersAndTheNextEpochWorks) {
  const int port = comm::pick_free_port();
  std::vector<std::string> errors(3), aborted(3);
  std::vector<float> sums(3, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto mesh = comm::PeerMesh::connect({{"127.0.0.1", port}, 3, r, std::chrono::seconds(20), std::chrono::seconds(20)});
        mesh->set_elastic(true);
        comm::TcpCommunicator world(mesh);
        NewWorld next;
        if (r == 0) {
          world.barrier();
          const std::vector<int> answered = call_the_roll(*mesh, {0, 1, 2});
          next = {.epoch = 1, .members = answered, .group_hosts = {0, 1, 2}, .num_physical_experts = 0};
          announce_new_world(*mesh, next);
        } else {
          std::byte b[1];
          try {
            // The roll call may come while a worker still finishes the barrier (rank 0 leaves it first): either
            // wait on a live peer is ended by the abort.
            world.barrier();
            world.recv(b, 3 - r);  // the other worker never sends
          } catch (const Error& e) {
            aborted[static_cast<size_t>(r)] = e.what();
          }
          next = answer_the_roll(*mesh);
        }
        mesh->begin_epoch(next.epoch, next.members);
        EXPECT_FALSE(mesh->aborted());
        auto fresh = comm::TcpCommunicator::over_members(mesh, next.members, next.epoch);
        float x = static_cast<float>(r + 1);
        fresh->all_reduce_sum(std::span<float>(&x, 1));
        sums[static_cast<size_t>(r)] = x;
        fresh->barrier();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    EXPECT_EQ(sums[static_cast<size_t>(r)], 6.0f) << "rank " << r;
  }
  for (int r = 1; r < 3; ++r) EXPECT_NE(aborted[static_cast<size_t>(r)].find("epoch 0 was aborted"), std::string::npos) << aborted[r];
}

// Polls `done` (bounded: 20 s); whether it came true.
bool eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 2000; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// A 3-rank elastic mesh over real sockets loses rank 2 (no goodbye: a kill); ranks 0 and 1 form epoch 1 without
// it. A new mesh started as rank 2 with the same rendezvous address joins the running world: every live rank
// readmits it, rank 0 lists it, its roll answer is read (not the old process's unread message), and the world of
// epoch 2 over all three moves data both ways. While the old rank 2 lives, a second rank 2 is refused.
TEST(ElasticWorld, AKilledRankRejoinsTheRunningWorld) {
  const int port = comm::pick_free_port();
  const auto init = [port](int r) {
    comm::DistInit d{{"127.0.0.1", port}, 3, r, std::chrono::seconds(20), std::chrono::seconds(20)};
    d.elastic = true;
    return d;
  };
  std::atomic<bool> rank2_dead{false};
  std::atomic<int> in_epoch1{0};  // the restart comes after the recovery (else it could beat the failure's detection)
  std::vector<std::string> errors(4);
  std::vector<float> sums(4, 0);
  std::string refused, rank1_aborted;
  std::vector<int> first_roll, second_roll;
  const auto last_world = [&](const std::shared_ptr<comm::PeerMesh>& mesh, const NewWorld& next, size_t slot) {
    mesh->begin_epoch(next.epoch, next.members);
    auto world = comm::TcpCommunicator::over_members(mesh, next.members, next.epoch);
    float x = static_cast<float>(mesh->rank() + 1);
    world->all_reduce_sum(std::span<float>(&x, 1));
    sums[slot] = x;
    world->barrier();
  };
  std::thread rank0([&] {
    try {
      auto mesh = comm::PeerMesh::connect(init(0));
      comm::TcpCommunicator(mesh).barrier();
      ASSERT_TRUE(eventually([&] { return rank2_dead && mesh->peer_failed(2); }));
      first_roll = call_the_roll(*mesh, {0, 1});
      announce_new_world(*mesh, {.epoch = 1, .members = first_roll, .group_hosts = {0, 1, 0}});
      mesh->begin_epoch(1, first_roll);
      ++in_epoch1;
      std::vector<int> rejoined;
      ASSERT_TRUE(eventually([&] { return !(rejoined = mesh->take_rejoined()).empty(); }));
      EXPECT_EQ(rejoined, std::vector<int>{2});
      second_roll = call_the_roll(*mesh, {0, 1, 2}, rejoined);
      const NewWorld next{.epoch = 2, .members = second_roll, .group_hosts = {0, 1, 2}};
      announce_new_world(*mesh, next);
      last_world(mesh, next, 0);
    } catch (const std::exception& e) {
      errors[0] = e.what();
    }
  });
  std::thread rank1([&] {
    try {
      auto mesh = comm::PeerMesh::connect(init(1));
      comm::TcpCommunicator(mesh).barrier();
      ASSERT_TRUE(eventually([&] { return mesh->peer_failed(2); }));
      NewWorld next = answer_the_roll(*mesh);
      mesh->begin_epoch(next.epoch, next.members);
      auto world = comm::TcpCommunicator::over_members(mesh, next.members, next.epoch);
      ++in_epoch1;
      std::byte b[1];
      try {
        world->recv(b, 0);  // rank 0 never sends: its roll call for the rejoin ends this wait
      } catch (const Error& e) {
        rank1_aborted = e.what();
      }
      last_world(mesh, answer_the_roll(*mesh), 1);
    } catch (const std::exception& e) {
      errors[1] = e.what();
    }
  });
  std::thread old_rank2([&] {
    try {
      auto mesh = comm::PeerMesh::connect(init(2));
      comm::TcpCommunicator(mesh).barrier();
      try {
        comm::PeerMesh::connect(init(2));
      } catch (const Error& e) {
        refused = e.what();
      }
      const std::byte stale[3]{};
      mesh->send_control(0, stale);  // left unread by rank 0: the newcomer's answer must not be taken for it
      throw Error("killed");  // the mesh goes while this unwinds: no goodbye, the peers see a failure
    } catch (const Error&) {
      rank2_dead = true;
    }
  });
  old_rank2.join();
  EXPECT_TRUE(eventually([&] { return in_epoch1 == 2; }));
  std::thread new_rank2([&] {
    try {
      auto mesh = comm::PeerMesh::connect(init(2));
      EXPECT_TRUE(mesh->joined_late());
      const NewWorld next = answer_the_roll(*mesh);
      EXPECT_EQ(next.epoch, 2u);
      last_world(mesh, next, 2);
    } catch (const std::exception& e) {
      errors[2] = e.what();
    }
  });
  for (std::thread* t : {&rank0, &rank1, &new_rank2}) t->join();
  EXPECT_NE(refused.find("rank 2 (from 127.0.0.1) is still in the world"), std::string::npos) << refused;
  EXPECT_EQ(first_roll, (std::vector<int>{0, 1}));
  EXPECT_EQ(second_roll, (std::vector<int>{0, 1, 2}));
  EXPECT_NE(rank1_aborted.find("epoch 1 was aborted"), std::string::npos) << rank1_aborted;
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    EXPECT_EQ(sums[static_cast<size_t>(r)], 6.0f) << "rank " << r;
  }
}

}  // namespace
}  // namespace fulcrum::server
