// In-process communicator: every collective against its definition, on awkward group sizes, plus split
// groups, point to point, and a failing rank that must not hang the others.
#include <gtest/gtest.h>

#include <numeric>

#include "comm/in_process_communicator.hpp"
#include "communicator_checks.hpp"
#include "eplb/error.hpp"

namespace fulcrum::comm {
namespace {

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, MatchTheirDefinitions) {
  const int n = GetParam();
  run_in_process(n, [n](int rank, Communicator& comm) { test::check_collectives(rank, n, comm); });
}

INSTANTIATE_TEST_SUITE_P(GroupSizes, Collectives, ::testing::Values(1, 2, 3, 4, 8));

TEST(Split, GroupsByColorOrderedByKey) {
  run_in_process(6, [](int rank, Communicator& comm) { test::check_split(rank, comm); });
}

TEST(RunInProcess, AFailingRankStopsTheOthersAndItsErrorIsReported) {
  try {
    run_in_process(4, [](int rank, Communicator& comm) {
      if (rank == 2) throw Error("rank 2 failed");
      comm.barrier();  // would wait forever for rank 2
      std::vector<int> v{0};
      comm.recv(writable_bytes_of(std::span<int>(v)), 2);
    });
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank 2 failed");
  }
}

TEST(RunInProcess, MismatchedAllToAllIsAnError) {
  EXPECT_THROW(run_in_process(2,
                              [](int rank, Communicator& comm) {
                                std::vector<std::byte> send(8), recv(8);
                                std::vector<int64_t> send_counts{4, 4};
                                std::vector<int64_t> recv_counts{rank == 0 ? 4 : 2, rank == 0 ? 4 : 6};
                                comm.all_to_all_v(send, send_counts, recv, recv_counts);
                              }),
               Error);
}

}  // namespace
}  // namespace fulcrum::comm
