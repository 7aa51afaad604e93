// comm::merge_slot_runs on in-process ranks: slots consecutive on both sides of a pair merge into one op per
// tensor, a run on one side only is cut where the other side's runs start, both sides get the same byte
// counts in the same order, and pairs of 3 ranks are handled independently.
#include <gtest/gtest.h>

#include <map>

#include "comm/in_process_communicator.hpp"
#include "comm/slot_runs.hpp"
#include "eplb/error.hpp"

namespace fulcrum::comm {
namespace {

constexpr int64_t kGateUpBytes = 6;
constexpr int64_t kDownBytes = 2;

// Storage of 16 slots per rank (addresses only; nothing is read or written).
struct FakeStorage {
  std::vector<std::byte> gate_up = std::vector<std::byte>(16 * kGateUpBytes);
  std::vector<std::byte> down = std::vector<std::byte>(16 * kDownBytes);
  SlotRunItem item(int peer, int index) {
    return {peer, index, gate_up.data() + index * kGateUpBytes, down.data() + index * kDownBytes};
  }
};

// (address offset in slots, slots) of each gate_up op, and the same from the down ops, per peer.
using Segments = std::map<int, std::vector<std::pair<int64_t, int64_t>>>;
template <typename Op>
Segments segments(const std::vector<Op>& ops, const FakeStorage& storage) {
  Segments out;
  for (size_t i = 0; i < ops.size(); i += 2) {
    const int64_t first = (ops[i].data - storage.gate_up.data()) / kGateUpBytes;
    const int64_t count = ops[i].bytes / kGateUpBytes;
    EXPECT_EQ(ops[i + 1].data - storage.down.data(), first * kDownBytes);
    EXPECT_EQ(ops[i + 1].bytes, count * kDownBytes);
    EXPECT_EQ(ops[i + 1].peer, ops[i].peer);
    out[ops[i].peer].emplace_back(first, count);
  }
  return out;
}

TEST(SlotRuns, MergeWhereBothSidesAreConsecutive) {
  // Rank 0 sends slots 3 4 5 9 10 to rank 1, which receives them into 0 1 2 3 7: the sender's runs start at
  // positions 0 and 3, the receiver's at 0 and 4, so the segments are [0, 3), [3, 4), [4, 5).
  // Rank 1 sends 2 3 to rank 0 (received into 12 13: one op per tensor).
  run_in_process(2, [](int rank, Communicator& comm) {
    FakeStorage storage;
    std::vector<SlotRunItem> sends, recvs;
    if (rank == 0) {
      for (const int i : {3, 4, 5, 9, 10}) sends.push_back(storage.item(1, i));
      for (const int i : {12, 13}) recvs.push_back(storage.item(1, i));
    } else {
      for (const int i : {0, 1, 2, 3, 7}) recvs.push_back(storage.item(0, i));
      for (const int i : {2, 3}) sends.push_back(storage.item(0, i));
    }
    const SlotRunOps ops = merge_slot_runs(comm, sends, recvs, kGateUpBytes, kDownBytes);
    const Segments sent = segments(ops.sends, storage), received = segments(ops.recvs, storage);
    if (rank == 0) {
      EXPECT_EQ(sent, (Segments{{1, {{3, 3}, {9, 1}, {10, 1}}}}));
      EXPECT_EQ(received, (Segments{{1, {{12, 2}}}}));
    } else {
      EXPECT_EQ(received, (Segments{{0, {{0, 3}, {3, 1}, {7, 1}}}}));
      EXPECT_EQ(sent, (Segments{{0, {{2, 2}}}}));
    }
  });
}

// 3 ranks, every rank sends its slots 0.. to each other rank in an order of its own; every pair's ops must
// agree in size and order (checked on the receiving side against what the sender reports).
TEST(SlotRuns, EveryPairAgreesOnItsSegments) {
  std::vector<std::map<int, std::vector<int64_t>>> sent_counts(3), received_counts(3);
  run_in_process(3, [&](int rank, Communicator& comm) {
    FakeStorage storage;
    std::vector<SlotRunItem> sends, recvs;
    for (int peer = 0; peer < 3; ++peer) {
      if (peer == rank) continue;
      // To peer: slots (rank + peer) .. in a pattern with gaps; from peer: into 5 * peer + {0 1 2 4}.
      for (const int i : {0, 1, 3, 4}) sends.push_back(storage.item(peer, rank + peer + i));
      for (const int i : {0, 1, 2, 4}) recvs.push_back(storage.item(peer, 5 * peer + i));
    }
    const SlotRunOps ops = merge_slot_runs(comm, sends, recvs, kGateUpBytes, kDownBytes);
    for (size_t i = 0; i < ops.sends.size(); i += 2) sent_counts[rank][ops.sends[i].peer].push_back(ops.sends[i].bytes);
    for (size_t i = 0; i < ops.recvs.size(); i += 2) {
      received_counts[rank][ops.recvs[i].peer].push_back(ops.recvs[i].bytes);
    }
  });
  const std::vector<int64_t> expected{2 * kGateUpBytes, kGateUpBytes, kGateUpBytes};  // cuts at 2 and 3
  for (int from = 0; from < 3; ++from) {
    for (int to = 0; to < 3; ++to) {
      if (from == to) continue;
      EXPECT_EQ(sent_counts[from][to], expected) << from << " -> " << to;
      EXPECT_EQ(received_counts[to][from], expected) << from << " -> " << to;
    }
  }
}

TEST(SlotRuns, APeerOutsideTheGroupIsAnError) {
  run_in_process(2, [](int rank, Communicator& comm) {
    FakeStorage storage;
    const std::vector<SlotRunItem> sends{storage.item(rank, 0)};
    try {
      merge_slot_runs(comm, sends, {}, kGateUpBytes, kDownBytes);
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("slot runs: peer " + std::to_string(rank) + " is not another rank of 2"),
                std::string::npos)
          << e.what();
    }
  });
}

}  // namespace
}  // namespace fulcrum::comm
