// `fulcrum serve --multi-process`: one process per rank (TCP between them), the HTTP front end and the
// scheduler in world rank 0's process. Real server processes and concurrent clients on loopback: greedy
// responses equal the threaded serve's on the same layout, with and without live EPLB (rebalances and
// migrations between processes), and the endpoints' recorder counts every rank's tokens once. A rank that
// is killed or stops responding ends the server (without --enable-elastic-ep) with one error line naming
// it and a non-zero exit, never a hang, and leaves no process behind.
#include <csignal>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "server_clients.hpp"
#include "server_http_util.hpp"
#include "server_process.hpp"
#include "server_test_util.hpp"
#include "process_list.hpp"

namespace fulcrum::test {
namespace {

constexpr int kClients = 8, kRequests = 2, kNew = 8;

std::vector<std::string> base_flags(const TempDir& dir) {
  // The folder in every command line marks this test's processes (processes_mentioning).
  return {"--tp", "2", "--ep", "2", "--ep-num-redundant-experts", "2", "--max-running-requests", "8",
          "--kv-pages", "256", "--page-size", "8", "--expert-distribution-dir", dir.path()};
}

std::vector<std::string> with(std::vector<std::string> flags, const std::vector<std::string>& more) {
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}


TEST(MultiProcessServe, GreedyResponsesEqualTheThreadedServeWithAndWithoutLiveEplb) {
  std::signal(SIGPIPE, SIG_IGN);
  TempDir dir("serve_multi_process");
  std::vector<std::vector<int32_t>> threaded;
  {
    ServerProcess server(skewed_served_model(), base_flags(dir), dir.file("threaded.log"));
    threaded = run_clients(server.port(), kClients, kRequests, kNew);
    EXPECT_EQ(server.terminate(), 0) << server.log();
  }
  ASSERT_EQ(threaded.size(), static_cast<size_t>(kClients * kRequests));
  {
    ServerProcess server(skewed_served_model(), with(base_flags(dir), {"--multi-process"}), dir.file("mp.log"));
    EXPECT_GT(server.wait_rank_pid(1), 0) << server.log();
    EXPECT_NE(server.log().find("2 rank processes"), std::string::npos) << server.log();
    ASSERT_EQ(post(server.port(), "/start_expert_distribution_record", "").first, 200);
    EXPECT_EQ(run_clients(server.port(), kClients, kRequests, kNew), threaded);
    // Rank 0's recorder got rank 1's counts too: every prompt token and kNew - 1 decode tokens, once each.
    ASSERT_EQ(post(server.port(), "/stop_expert_distribution_record", "").first, 200);
    const auto [status, dump] = post(server.port(), "/dump_expert_distribution_record", R"({"name": "dist.json"})");
    ASSERT_EQ(status, 200) << dump.dump();
    int64_t tokens = 0;
    for (const auto& p : all_prompts(kClients, kRequests)) tokens += static_cast<int64_t>(p.size()) + kNew - 1;
    EXPECT_EQ(dump["num_tokens"], tokens);
    EXPECT_EQ(server.terminate(), 0) << server.log();
  }
  {
    ServerProcess server(skewed_served_model(),
                         with(base_flags(dir), {"--multi-process", "--enable-eplb", "--eplb-rebalance-num-iterations",
                                                "4", "--expert-distribution-recorder-buffer-size", "8"}),
                         dir.file("mp_eplb.log"));
    EXPECT_EQ(run_clients(server.port(), kClients, kRequests, kNew), threaded);
    const auto rebalances = logged_rebalances(server.log());
    ASSERT_GE(rebalances.size(), 1u) << server.log();
    EXPECT_GT(rebalances[0].second, rebalances[0].first);
    EXPECT_NE(server.log().find("migration complete after"), std::string::npos) << server.log();
    std::map<std::string, double> m = metrics(server.port());
    EXPECT_GE(m["fulcrum_eplb_rebalances_total"], 1);
    EXPECT_GT(m["fulcrum_eplb_bytes_migrated_total"], 0);
    EXPECT_EQ(server.terminate(), 0) << server.log();
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);  // every rank process is gone
}

// Without --enable-elastic-ep a lost rank ends the server: one line naming it, exit status 1, no hang.
TEST(MultiProcessServe, AKilledOrStoppedRankEndsTheServerWithOneErrorLine) {
  std::signal(SIGPIPE, SIG_IGN);
  for (const int sig : {SIGKILL, SIGSTOP}) {
    TempDir dir("serve_multi_process_fault");
    ServerProcess server(skewed_served_model(),
                         with(base_flags(dir), {"--multi-process", "--elastic-ep-timeout", "2"}), dir.file("serve.log"));
    const pid_t rank1 = server.wait_rank_pid(1);
    ASSERT_GT(rank1, 0) << server.log();
    ASSERT_EQ(::kill(rank1, sig), 0);
    // A request now fails (rank 0 waits for rank 1 at most the timeout) instead of hanging.
    const auto [status, out] = post(server.port(), "/v1/completions", json{{"prompt", prompt_of(0, 0)}, {"max_tokens", 4}}.dump());
    EXPECT_NE(status, 200) << out.dump();
    EXPECT_EQ(server.wait_exit(60), 1) << server.log();
    const std::string log = server.log();
    EXPECT_EQ(count_of(log, "fulcrum: error: "), 1) << log;
    const std::string error = log.substr(log.find("fulcrum: error: "));
    EXPECT_NE(error.find("rank 1"), std::string::npos) << log;
    EXPECT_NE(error.find(sig == SIGKILL ? "was killed by signal 9" : "not even a heartbeat, for 2.0 s"), std::string::npos) << log;
    EXPECT_EQ(processes_mentioning(dir.path()), 0) << log;
  }
}

}  // namespace
}  // namespace fulcrum::test
