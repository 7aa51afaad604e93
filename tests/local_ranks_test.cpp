// The rank-process launcher of tests_cuda's NCCL tests and fulcrum_nccl_bench (comm/local_ranks.hpp), on CPU:
// fulcrum_tests re-executes itself as rank processes of one LocalRankChild.* test each; they join a TCP world.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "comm/exec_image.hpp"
#include "comm/local_ranks.hpp"
#include "comm/tcp_communicator.hpp"
#include "eplb/error.hpp"

namespace fulcrum::comm {
namespace {

using namespace std::chrono_literals;

#define FULCRUM_LOCAL_RANK_ONLY(me)                 \
  const std::optional<LocalRank> me = local_rank(); \
  if (!me) GTEST_SKIP() << "runs as a rank process of LocalRanks.*"

std::vector<int> run_child(int n, const std::string& child_test, std::chrono::seconds timeout = 60s) {
  return run_local_rank_processes(n, {"fulcrum_tests", "--gtest_filter=LocalRankChild." + child_test}, timeout);
}

TEST(LocalRankChild, GathersEveryRank) {
  FULCRUM_LOCAL_RANK_ONLY(me);
  TcpCommunicator world(PeerMesh::connect(me->dist_init(20s)));
  ASSERT_EQ(world.size(), me->size);
  ASSERT_EQ(world.rank(), me->rank);
  const int32_t mine = me->rank;
  std::vector<int32_t> all(static_cast<size_t>(me->size), -1);
  world.all_gather(std::as_bytes(std::span<const int32_t>(&mine, 1)), std::as_writable_bytes(std::span<int32_t>(all)));
  for (int r = 0; r < me->size; ++r) EXPECT_EQ(all[r], r);
}

// Rank 1's gtest failure report in the log is this test's expected outcome.
TEST(LocalRankChild, FailsOnRank1) {
  FULCRUM_LOCAL_RANK_ONLY(me);
  EXPECT_NE(me->rank, 1);
}

TEST(LocalRankChild, Hangs) {
  FULCRUM_LOCAL_RANK_ONLY(me);
  std::this_thread::sleep_for(60s);
}

TEST(LocalRanks, ProcessesJoinOneWorld) {
  EXPECT_EQ(run_child(3, "GathersEveryRank"), (std::vector<int>{0, 0, 0}));
}

TEST(LocalRanks, EachRanksStatusIsItsOwn) {
  EXPECT_EQ(run_child(2, "FailsOnRank1"), (std::vector<int>{0, 1}));
}

TEST(LocalRanks, AHangingRankIsKilledAtTheTimeout) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(run_child(1, "Hangs", 1s), (std::vector<int>{-1}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
}

TEST(LocalRanks, MalformedEnvironmentIsAOneLineError) {
  ASSERT_FALSE(local_rank().has_value());  // this process was not launched as a rank
  ::setenv("FULCRUM_LOCAL_RANK", "2 2 5000", 1);  // rank outside [0, size)
  try {
    local_rank();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("malformed FULCRUM_LOCAL_RANK='2 2 5000'"), std::string::npos) << e.what();
  }
  ::unsetenv("FULCRUM_LOCAL_RANK");
}


// What a rank process is started with: the arguments as given, the launcher's environment with each override
// replacing its variable (once), and NVLink multicast off.
TEST(ExecImage, OverridesReplaceTheLaunchersVariablesAndMulticastStaysOff) {
  ::setenv("FULCRUM_TEST_KEEP", "kept", 1);
  ::setenv("FULCRUM_TEST_SET", "old", 1);
  ::setenv("FULCRUM_TEST_SET_LONGER", "untouched", 1);  // shares a prefix with an override: not replaced
  ::setenv("NCCL_NVLS_ENABLE", "1", 1);
  const ExecImage image = exec_image({"prog", "--flag", "value"}, {{"FULCRUM_TEST_SET", "new value"}});
  ::unsetenv("FULCRUM_TEST_KEEP");
  ::unsetenv("FULCRUM_TEST_SET");
  ::unsetenv("FULCRUM_TEST_SET_LONGER");
  ::unsetenv("NCCL_NVLS_ENABLE");
  ASSERT_EQ(image.argv.size(), 4u);
  EXPECT_EQ(std::string(image.argv[0]), "prog");
  EXPECT_EQ(std::string(image.argv[2]), "value");
  EXPECT_EQ(image.argv[3], nullptr);
  ASSERT_FALSE(image.envp.empty());
  EXPECT_EQ(image.envp.back(), nullptr);
  std::vector<std::string> env(image.envp.begin(), image.envp.end() - 1);
  const auto count = [&](const std::string& entry) { return std::count(env.begin(), env.end(), entry); };
  EXPECT_EQ(count("FULCRUM_TEST_KEEP=kept"), 1);
  EXPECT_EQ(count("FULCRUM_TEST_SET=new value"), 1);
  EXPECT_EQ(count("FULCRUM_TEST_SET=old"), 0);
  EXPECT_EQ(count("FULCRUM_TEST_SET_LONGER=untouched"), 1);
  EXPECT_EQ(count("NCCL_NVLS_ENABLE=0"), 1);
  EXPECT_EQ(count("NCCL_NVLS_ENABLE=1"), 0);
}

}  // namespace
}  // namespace fulcrum::comm
