// The engine's ranks as persistent threads: commands run on every rank in order, collectives inside
// them work, a failing rank aborts the world instead of hanging it, and local errors leave it running.
#include <atomic>

#include <gtest/gtest.h>

#include "engine/rank_threads.hpp"
#include "eplb/error.hpp"

namespace fulcrum::engine {
namespace {

TEST(EngineRankThreads, CommandsRunOnEveryRankInOrderWithCollectives) {
  RankThreads threads(4);
  std::vector<std::vector<float>> seen(4);
  for (int command = 0; command < 50; ++command) {
    threads.run([&](int rank, comm::Communicator& world) {
      std::vector<float> value = {static_cast<float>(rank + command)};
      world.all_reduce_sum(value);  // 0 + 1 + 2 + 3 + 4 * command
      seen[static_cast<size_t>(rank)].push_back(value[0]);
    });
  }
  for (const auto& per_rank : seen) {
    ASSERT_EQ(per_rank.size(), 50u);
    for (int command = 0; command < 50; ++command) EXPECT_EQ(per_rank[command], 6.0f + 4.0f * command);
  }
}

TEST(EngineRankThreads, AFailingRankAbortsTheWorldAndEveryLaterCallFails) {
  RankThreads threads(4);
  std::atomic<int> barriers_passed{0};
  const auto fail_on_rank_two = [&](int rank, comm::Communicator& world) {
    if (rank == 2) throw Error("rank 2 cannot go on");
    world.barrier();  // the others wait here for rank 2: aborted, not hung
    ++barriers_passed;
  };
  try {
    threads.run(fail_on_rank_two);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank 2 cannot go on");
  }
  EXPECT_EQ(barriers_passed, 0);
  EXPECT_THROW(threads.run([](int, comm::Communicator&) {}), Error);
  EXPECT_THROW(threads.run_local([](int, comm::Communicator&) {}), Error);
}

TEST(EngineRankThreads, LocalErrorsAreReportedPerRankAndTheWorldGoesOn) {
  RankThreads threads(3);
  const std::vector<std::exception_ptr> errors = threads.run_local([](int rank, comm::Communicator&) {
    if (rank == 1) throw Error("rank 1 is full");
  });
  ASSERT_EQ(errors.size(), 3u);
  EXPECT_FALSE(errors[0]);
  EXPECT_TRUE(errors[1]);
  EXPECT_FALSE(errors[2]);
  std::vector<float> sums(3);
  threads.run([&](int rank, comm::Communicator& world) {
    std::vector<float> value = {1.0f};
    world.all_reduce_sum(value);
    sums[static_cast<size_t>(rank)] = value[0];
  });
  EXPECT_EQ(sums, std::vector<float>(3, 3.0f));
}

}  // namespace
}  // namespace fulcrum::engine
