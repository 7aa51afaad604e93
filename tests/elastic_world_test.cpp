// Elastic EP's pieces (server/elastic_world.hpp, the mesh's epochs): the new world message, where the lost
// KV groups go, the survivors' slots and placement, the layout rule, and a recovery over real sockets (an
// abort ends waits on live peers, the roll call, the next epoch's world).
#include <thread>

#include <gtest/gtest.h>

#include "comm/tcp_communicator.hpp"
#include "comm/tcp_socket.hpp"
#include "eplb/error.hpp"
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

}  // namespace
}  // namespace fulcrum::server
