// `fulcrum serve --multi-process --enable-elastic-ep`: real rank processes and concurrent clients (half of
// them streaming). A rank killed (SIGKILL) or stopped (SIGSTOP, found by --elastic-ep-timeout) while every
// request is mid-decode, or two ranks killed one after the other: no request fails, every greedy response
// equals the fault-free (threaded) server's on the same layout, the survivors form a new world and say so,
// and the metrics count the recovery. With the prefix cache on (prompts sharing a prefix), the recovery
// drops the cache whole and it refills. Layouts elastic EP does not support are refused in one line.
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <regex>

#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "comm/tcp_socket.hpp"
#include "server_clients.hpp"
#include "server_http_util.hpp"
#include "server_process.hpp"
#include "server_test_util.hpp"
#include "process_list.hpp"

namespace fulcrum::test {
namespace {

constexpr int kClients = 32, kNew = 48;

std::vector<std::string> layout_flags(const TempDir& dir, bool prefix_cache = false) {
  std::vector<std::string> flags = {"--tp", "4", "--dp", "4", "--enable-dp-attention", "--ep", "4",
                                    "--max-running-requests", "32", "--kv-pages", "128", "--page-size", "8",
                                    "--expert-distribution-dir", dir.path()};
  if (!prefix_cache) flags.push_back("--disable-radix-cache");
  return flags;
}

std::vector<std::string> elastic_flags(const TempDir& dir, const std::string& timeout_s = "2", bool prefix_cache = false) {
  std::vector<std::string> flags = layout_flags(dir, prefix_cache);
  flags.insert(flags.end(), {"--multi-process", "--enable-elastic-ep", "--elastic-ep-timeout", timeout_s});
  return flags;
}

// The fault-free run: the threaded server on the same layout.
const std::vector<std::vector<int32_t>>& fault_free() {
  static const std::vector<std::vector<int32_t>> tokens = [] {
    TempDir dir("serve_elastic_reference");
    ServerProcess server(skewed_served_model(), layout_flags(dir), dir.file("threaded.log"));
    auto got = run_clients(server.port(), kClients, 1, kNew);
    EXPECT_EQ(server.terminate(), 0) << server.log();
    return got;
  }();
  return tokens;
}

// Request (c, r) of the prefix-cache cases: 3 whole pages (--page-size 8) every client shares, then its own
// prompt_of(c, r).
std::vector<int32_t> shared_prefix_prompt(int c, int r) {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 24; ++i) prompt.push_back((11 * i + 7) % 256);
  const std::vector<int32_t> own = prompt_of(c, r);
  prompt.insert(prompt.end(), own.begin(), own.end());
  return prompt;
}

// The fault-free threaded runs of shared_prefix_prompt, with the prefix cache on and off.
const std::vector<std::vector<int32_t>>& fault_free_shared_prefix(bool prefix_cache) {
  const auto run = [](bool cache) {
    TempDir dir("serve_elastic_reference_prefix");
    ServerProcess server(skewed_served_model(), layout_flags(dir, cache), dir.file("threaded.log"));
    auto got = run_clients(server.port(), kClients, 1, kNew, shared_prefix_prompt);
    if (cache) EXPECT_GT(metrics(server.port())["fulcrum_prefix_cache_hit_tokens_total"], 0);
    EXPECT_EQ(server.terminate(), 0) << server.log();
    return got;
  };
  static const std::vector<std::vector<int32_t>> on = run(true), off = run(false);
  return prefix_cache ? on : off;
}

// Waits (bounded) until the server has generated more than `tokens` tokens in all: every client's request is
// then running, mid-decode (each asks kNew tokens).
bool wait_generated(int port, double tokens) {
  for (int i = 0; i < 6000; ++i) {
    if (metrics(port)["fulcrum_generation_tokens_total"] > tokens) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// Clients run while `fault` strikes once every request is mid-decode; returns their tokens.
std::vector<std::vector<int32_t>> clients_across(
    const ServerProcess& server, const std::function<void()>& fault,
    const std::function<std::vector<int32_t>(int, int)>& prompt = prompt_of) {
  const double before = metrics(server.port())["fulcrum_generation_tokens_total"];
  std::vector<std::vector<int32_t>> got;
  std::thread clients([&] { got = run_clients(server.port(), kClients, 1, kNew, prompt); });
  EXPECT_TRUE(wait_generated(server.port(), before + 4 * kClients));
  fault();
  clients.join();
  return got;
}

// The recovery times the log reports, in order.
std::vector<double> recovery_seconds(const std::string& log) {
  const std::regex recovered("elastic: recovered in ([0-9.]+) s");
  std::vector<double> seconds;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), recovered); it != std::sregex_iterator(); ++it) {
    seconds.push_back(std::stod((*it)[1]));
  }
  return seconds;
}

// One rebuild's expert slots by source, over the whole world (world rank 0's line).
struct SlotSources {
  int local = 0, received = 0, copied = 0, checkpoint = 0, experts_from_checkpoint = 0;
  int64_t bytes_received = 0;
  int total() const { return local + received + copied + checkpoint; }
};

// Every rebuild's line, in order.
std::vector<SlotSources> slot_sources(const std::string& log) {
  const std::regex line("elastic: expert slots of epoch [0-9]+'s world: ([0-9]+) copied locally, ([0-9]+) received "
                        "from surviving replicas \\(([0-9]+) bytes\\), ([0-9]+) copied from the rank's first slot of "
                        "the same expert, ([0-9]+) read from the checkpoint \\(([0-9]+) logical expert\\(s\\) held "
                        "by no survivor\\); non-expert weights read from the checkpoint");
  std::vector<SlotSources> all;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator(); ++it) {
    all.push_back({.local = std::stoi((*it)[1]), .received = std::stoi((*it)[2]), .copied = std::stoi((*it)[4]),
                   .checkpoint = std::stoi((*it)[5]), .experts_from_checkpoint = std::stoi((*it)[6]),
                   .bytes_received = std::stoll((*it)[3])});
    std::cout << "[ elastic ] expert slots: " << all.back().local << " local, " << all.back().received
              << " received (" << all.back().bytes_received << " bytes), " << all.back().copied
              << " copied from the rank's own slot, " << all.back().checkpoint << " from the checkpoint\n";
  }
  return all;
}

// `reprefilled`: the fault struck live requests (mid-decode), whose state the recovery rebuilt.
void expect_recovered(const ServerProcess& server, int recoveries, int live_ranks, const std::string& lost,
                      bool reprefilled = true) {
  const std::string log = server.log();
  EXPECT_EQ(count_of(log, "elastic: fault detected"), recoveries) << log;
  EXPECT_NE(log.find("without rank(s) " + lost), std::string::npos) << log;
  EXPECT_NE(log.find(fmt::format("re-planned onto tp {} (attention: {} DP group(s) x 1 TP), ep {}", live_ranks,
                                 live_ranks, live_ranks)),
            std::string::npos)
      << log;
  EXPECT_GE(count_of(log, "elastic: re-prefilling "), recoveries) << log;
  EXPECT_EQ(count_of(log, "fulcrum: error: "), 0) << log;
  const std::vector<double> seconds = recovery_seconds(log);
  ASSERT_EQ(seconds.size(), static_cast<size_t>(recoveries)) << log;
  for (const double s : seconds) std::cout << "[ elastic ] recovered in " << s << " s\n";
  std::map<std::string, double> m = metrics(server.port());
  EXPECT_EQ(m["fulcrum_live_ranks"], live_ranks);
  EXPECT_EQ(m["fulcrum_elastic_recoveries_total"], recoveries);
  if (reprefilled) EXPECT_GE(m["fulcrum_elastic_reprefilled_requests_total"], 1) << log;
  EXPECT_NEAR(m["fulcrum_elastic_recovery_seconds"], seconds.back(), 0.0005);  // the log rounds to ms
}

TEST(ElasticServe, AKilledRankUnderConcurrentClientsLosesNoRequestAndChangesNoOutput) {
  std::signal(SIGPIPE, SIG_IGN);
  const auto& reference = fault_free();
  ASSERT_EQ(reference.size(), static_cast<size_t>(kClients));
  TempDir dir("serve_elastic_kill");
  {
    ServerProcess server(skewed_served_model(), elastic_flags(dir), dir.file("serve.log"));
    const pid_t rank2 = server.wait_rank_pid(2);
    ASSERT_GT(rank2, 0) << server.log();
    EXPECT_EQ(clients_across(server, [&] { ASSERT_EQ(::kill(rank2, SIGKILL), 0); }), reference);
    EXPECT_NE(server.log().find("fulcrum: rank 2 lost: rank 2 (pid " + std::to_string(rank2) + ") was killed by signal 9"),
              std::string::npos)
        << server.log();
    expect_recovered(server, 1, 3, "2");
    // 128 experts, 4 MoE layers, 32 per rank and no redundant slot: rank 2's 32 of each layer no survivor holds
    // come from the checkpoint (129 slots: its extra slot may hold one of them too), every other slot from a copy.
    const std::vector<SlotSources> sources = slot_sources(server.log());
    ASSERT_EQ(sources.size(), 1u) << server.log();
    EXPECT_EQ(sources[0].experts_from_checkpoint, 4 * 32) << server.log();
    EXPECT_GE(sources[0].checkpoint, 4 * 32);
    EXPECT_LE(sources[0].checkpoint, 4 * 33);
    EXPECT_EQ(sources[0].total(), 4 * 129);
    EXPECT_EQ(sources[0].received == 0, sources[0].bytes_received == 0);
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew), reference);  // and the smaller world goes on
    EXPECT_EQ(server.terminate(), 0) << server.log();
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);
}

// The prefix cache on, every client's prompt beginning with the same 3 pages: when the rank dies the cache
// holds those shared pages (in use by the running requests) and whatever finished requests left. The
// recovery drops it whole, every request is re-prefilled (sharing the prefix again), and the cache refills.
TEST(ElasticServe, AKilledRankWithThePrefixCacheOnDropsItAndItRefills) {
  std::signal(SIGPIPE, SIG_IGN);
  const auto& reference = fault_free_shared_prefix(true);
  ASSERT_EQ(reference.size(), static_cast<size_t>(kClients));
  // The prefix cache shares K/V bitwise: the same tokens without it.
  EXPECT_EQ(reference, fault_free_shared_prefix(false));
  TempDir dir("serve_elastic_prefix");
  {
    ServerProcess server(skewed_served_model(), elastic_flags(dir, "2", /*prefix_cache=*/true), dir.file("serve.log"));
    const pid_t rank2 = server.wait_rank_pid(2);
    ASSERT_GT(rank2, 0) << server.log();
    std::map<std::string, double> at_fault;
    const auto kill = [&] {
      at_fault = metrics(server.port());
      ASSERT_EQ(::kill(rank2, SIGKILL), 0);
    };
    EXPECT_EQ(clients_across(server, kill, shared_prefix_prompt), reference);
    expect_recovered(server, 1, 3, "2");
    const std::string log = server.log();
    EXPECT_GE(at_fault["fulcrum_prefix_cache_pages"], 3) << "the shared prefix is cached when the rank dies";
    const std::regex dropped("elastic: dropped the prefix cache with the old KV pools: ([0-9]+) cached prefix\\(es\\), "
                             "([0-9]+) page\\(s\\) over 4 group\\(s\\)");
    std::smatch match;
    ASSERT_TRUE(std::regex_search(log, match, dropped)) << log;
    EXPECT_EQ(count_of(log, "elastic: dropped the prefix cache"), 1) << log;
    EXPECT_GT(match.position(0), static_cast<std::ptrdiff_t>(log.find("elastic: fault detected"))) << log;
    std::cout << "[ elastic ] " << match[0] << "; cache hit tokens " << at_fault["fulcrum_prefix_cache_hit_tokens_total"]
              << " at the fault\n";
    EXPECT_GE(std::stoi(match[1]), 1) << log;
    EXPECT_GE(std::stoi(match[2]), 3) << log;
    std::map<std::string, double> m = metrics(server.port());
    EXPECT_EQ(m["fulcrum_prefix_cache_dropped_pages_total"], std::stoi(match[2]));
    EXPECT_EQ(m["fulcrum_requests_total{finish_reason=\"error\"}"], 0);
    // Refilled: the re-prefilled requests shared the prefix again, and the next clients find it.
    EXPECT_GT(m["fulcrum_prefix_cache_hit_tokens_total"], at_fault["fulcrum_prefix_cache_hit_tokens_total"]);
    EXPECT_GT(m["fulcrum_prefix_cache_pages"], 0);
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew, shared_prefix_prompt), reference);
    const std::map<std::string, double> after = metrics(server.port());
    EXPECT_GE(after.at("fulcrum_prefix_cache_hit_tokens_total") - m["fulcrum_prefix_cache_hit_tokens_total"],
              24.0 * (kClients - 4));  // every request but maybe the first of each group
    EXPECT_EQ(after.at("fulcrum_prefix_cache_dropped_pages_total"), std::stoi(match[2]));
    std::cout << "[ elastic ] cache hit tokens " << m["fulcrum_prefix_cache_hit_tokens_total"] << " after the clients across "
              << "the fault, " << after.at("fulcrum_prefix_cache_hit_tokens_total") << " after 32 more\n";
    EXPECT_EQ(server.terminate(), 0) << server.log();
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);
}

TEST(ElasticServe, AStoppedRankIsDroppedAfterTheTimeout) {
  std::signal(SIGPIPE, SIG_IGN);
  const auto& reference = fault_free();
  TempDir dir("serve_elastic_stop");
  {
    ServerProcess server(skewed_served_model(), elastic_flags(dir), dir.file("serve.log"));
    const pid_t rank1 = server.wait_rank_pid(1);
    ASSERT_GT(rank1, 0) << server.log();
    EXPECT_EQ(clients_across(server, [&] { ASSERT_EQ(::kill(rank1, SIGSTOP), 0); }), reference);
    expect_recovered(server, 1, 3, "1");
    // Found by the heartbeat timeout (the recovery time starts there: fault detected -> first completed step).
    EXPECT_NE(server.log().find("sent nothing, not even a heartbeat, for 2.0 s"), std::string::npos) << server.log();
    EXPECT_EQ(server.terminate(), 0) << server.log();  // the stopped process is killed by the launcher
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);
}

TEST(ElasticServe, TwoRanksKilledOneAfterTheOther) {
  std::signal(SIGPIPE, SIG_IGN);
  const auto& reference = fault_free();
  TempDir dir("serve_elastic_twice");
  {
    ServerProcess server(skewed_served_model(), elastic_flags(dir), dir.file("serve.log"));
    const pid_t rank1 = server.wait_rank_pid(1), rank3 = server.wait_rank_pid(3);
    ASSERT_GT(rank1, 0) << server.log();
    ASSERT_GT(rank3, 0) << server.log();
    EXPECT_EQ(clients_across(server, [&] { ASSERT_EQ(::kill(rank1, SIGKILL), 0); }), reference);
    expect_recovered(server, 1, 3, "1");
    EXPECT_EQ(clients_across(server, [&] { ASSERT_EQ(::kill(rank3, SIGKILL), 0); }), reference);
    expect_recovered(server, 2, 2, "3");
    EXPECT_NE(server.log().find("new world (epoch 2): ranks 0, 2 of the 4 launched"), std::string::npos) << server.log();
    EXPECT_EQ(server.terminate(), 0) << server.log();
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);
}

// A rank lost while the world rebuilds after another's loss: rank 3 exits in the middle of its rebuild of epoch 1
// (FULCRUM_ELASTIC_TEST_EXIT_IN_REBUILD, a test hook), so the rebuild fails on every survivor; they roll again
// without it and the one recovery ends on ranks 0 and 1, with the outputs of the fault-free run.
TEST(ElasticServe, ARankLostDuringTheRebuildIsDroppedAndTheRebuildRetried) {
  std::signal(SIGPIPE, SIG_IGN);
  const auto& reference = fault_free();
  TempDir dir("serve_elastic_rebuild_fails");
  {
    ::setenv("FULCRUM_ELASTIC_TEST_EXIT_IN_REBUILD", "1:3", 1);
    ServerProcess server(skewed_served_model(), elastic_flags(dir), dir.file("serve.log"));
    ::unsetenv("FULCRUM_ELASTIC_TEST_EXIT_IN_REBUILD");
    const pid_t rank2 = server.wait_rank_pid(2);
    ASSERT_GT(rank2, 0) << server.log();
    EXPECT_EQ(clients_across(server, [&] { ASSERT_EQ(::kill(rank2, SIGKILL), 0); }), reference);
    const std::string log = server.log();
    EXPECT_NE(log.find("mesh rank 3 exits during the rebuild of epoch 1"), std::string::npos) << log;
    EXPECT_NE(log.find("mesh rank 1: the rebuild of epoch 1 failed"), std::string::npos) << log;
    EXPECT_NE(log.find("new world (epoch 2): ranks 0, 1 of the 4 launched"), std::string::npos) << log;
    expect_recovered(server, 1, 2, "2");
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew), reference);
    EXPECT_EQ(server.terminate(), 0) << server.log();
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);
}

// A rank alive but stuck: rank 2 is killed, and rank 3 keeps sending heartbeats but never answers the roll call
// for epoch 1 (FULCRUM_ELASTIC_TEST_SILENT_IN_ROLL, a test hook). Rank 0 expels it one --elastic-ep-timeout after
// calling the roll instead of waiting for it forever; the one recovery ends on ranks 0 and 1, with the outputs of
// the fault-free run, and the expelled process ends.
TEST(ElasticServe, ARankAliveButSilentInTheRollCallIsExpelledAfterTheTimeout) {
  std::signal(SIGPIPE, SIG_IGN);
  const auto& reference = fault_free();
  TempDir dir("serve_elastic_silent_roll");
  {
    ::setenv("FULCRUM_ELASTIC_TEST_SILENT_IN_ROLL", "1:3", 1);
    ServerProcess server(skewed_served_model(), elastic_flags(dir), dir.file("serve.log"));
    ::unsetenv("FULCRUM_ELASTIC_TEST_SILENT_IN_ROLL");
    const pid_t rank2 = server.wait_rank_pid(2);
    ASSERT_GT(rank2, 0) << server.log();
    const auto start = std::chrono::steady_clock::now();
    EXPECT_EQ(clients_across(server, [&] { ASSERT_EQ(::kill(rank2, SIGKILL), 0); }), reference);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << "[ elastic ] clients across the fault took " << seconds << " s\n";
    const std::string log = server.log();
    EXPECT_NE(log.find("mesh rank 3 stays silent in the roll call of epoch 1"), std::string::npos) << log;
    EXPECT_NE(log.find("rank(s) 3 alive but without an answer to the roll call within 2.0 s (--elastic-ep-timeout): "
                       "expelled"),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("new world (epoch 1): ranks 0, 1 of the 4 launched, without rank(s) 2, 3"), std::string::npos)
        << log;
    EXPECT_EQ(count_of(log, "elastic: fault detected"), 1) << log;
    const std::map<std::string, double> m = metrics(server.port());
    EXPECT_EQ(m.at("fulcrum_live_ranks"), 2);
    EXPECT_EQ(m.at("fulcrum_elastic_recoveries_total"), 1);
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew), reference);
    EXPECT_EQ(server.terminate(), 0) << server.log();
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);
}

// A rank whose work stops while its process lives: rank 3 stalls at the start of pass 6 under the 32 clients,
// its heartbeats going on (FULCRUM_ELASTIC_TEST_STALL_IN_PASS, a test hook). The ranks waiting on it in that pass
// give up after --elastic-ep-timeout (no progress), the roll call expels it after another, and the world goes on
// without it with the outputs of the fault-free run.
TEST(ElasticServe, ARankWhoseWorkStallsIsFoundByTheProgressBoundAndExpelled) {
  std::signal(SIGPIPE, SIG_IGN);
  const auto& reference = fault_free();
  TempDir dir("serve_elastic_stall");
  {
    ::setenv("FULCRUM_ELASTIC_TEST_STALL_IN_PASS", "6:3", 1);
    ServerProcess server(skewed_served_model(), elastic_flags(dir), dir.file("serve.log"));
    ::unsetenv("FULCRUM_ELASTIC_TEST_STALL_IN_PASS");
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew), reference);
    const std::string log = server.log();
    EXPECT_NE(log.find("mesh rank 3 stalls in pass 6"), std::string::npos) << log;
    EXPECT_NE(log.find("which is alive but made no progress"), std::string::npos) << log;
    EXPECT_NE(log.find("rank(s) 3 alive but without an answer to the roll call within 2.0 s"), std::string::npos) << log;
    expect_recovered(server, 1, 3, "3");
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew), reference);
    EXPECT_EQ(server.terminate(), 0) << server.log();
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);
}

// Live EPLB (rebalances and slot migrations between the processes) before and after the fault: the new
// world's ranks run it again from the re-planned placement.
TEST(ElasticServe, AKilledRankWithLiveEplbChangesNoOutput) {
  std::signal(SIGPIPE, SIG_IGN);
  const auto& reference = fault_free();
  TempDir dir("serve_elastic_eplb");
  {
    std::vector<std::string> flags = elastic_flags(dir);
    flags.insert(flags.end(), {"--ep-num-redundant-experts", "4", "--enable-eplb", "--eplb-rebalance-num-iterations", "4",
                               "--expert-distribution-recorder-buffer-size", "8"});
    ServerProcess server(skewed_served_model(), flags, dir.file("serve.log"));
    const pid_t rank3 = server.wait_rank_pid(3);
    ASSERT_GT(rank3, 0) << server.log();
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew), reference);
    EXPECT_GE(logged_rebalances(server.log()).size(), 1u) << server.log();
    EXPECT_EQ(clients_across(server, [&] { ASSERT_EQ(::kill(rank3, SIGKILL), 0); }), reference);
    expect_recovered(server, 1, 3, "3");
    EXPECT_NE(server.log().find("129 slots per MoE layer"), std::string::npos) << server.log();  // 132 / 4 x 3 < 128
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew), reference);
    EXPECT_EQ(server.terminate(), 0) << server.log();
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);
}

// The first rebalance whose migration (one changed layer per pass, RankEplb) is in flight after the last
// completed request: its index, or -1. A rebalance that changed L layers switches its first layer in the
// pass that planned it and logs "rebalance K: migration complete" L - 1 passes later.
int rebalance_in_flight(const std::string& log) {
  const std::regex started(R"(eplb: rebalance (\d+) at pass \d+: MoE layers [^:]*: balancedness [0-9.]+ -> [0-9.]+, (\d+) layers changed)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), started); it != std::sregex_iterator(); ++it) {
    const std::string k = (*it)[1];
    if (std::stoi((*it)[2]) >= 2 && log.find("rebalance " + k + ": migration complete") == std::string::npos) {
      return std::stoi(k);
    }
  }
  return -1;
}

// Rank 2 is killed while a live migration is in flight. The world runs one-pass requests (1 token each, the
// server idle between them) until the log shows a rebalance that changed several layers and has not completed:
// its first layer is switched, the others are still old and will be written in the next passes (the server being
// idle, the migration stays in flight however slow the test is). Then rank 2 is killed and the 32 clients come:
// their first command finds the lost rank, and every one of them is served by the recovered world. What the code does with the half-done
// rebalance: it is dropped. The rebuild destroys the old world's RankEplb (manager, target placement and
// migration) on every survivor, plans a new placement afresh with the default planner on the survivors'
// recorded loads (not the half-done target, not the half-migrated live map), and loads every slot of it from
// the checkpoint, so no slot half-written by the migration is ever read. The new world runs EPLB from there.
TEST(ElasticServe, ARankKilledDuringALiveMigrationChangesNoOutput) {
  std::signal(SIGPIPE, SIG_IGN);
  const auto& reference = fault_free();
  TempDir dir("serve_elastic_migration");
  {
    std::vector<std::string> flags = elastic_flags(dir);
    flags.insert(flags.end(), {"--ep-num-redundant-experts", "4", "--enable-eplb", "--eplb-rebalance-num-iterations", "8",
                               "--expert-distribution-recorder-buffer-size", "8"});
    ServerProcess server(skewed_served_model(), flags, dir.file("serve.log"));
    const pid_t rank2 = server.wait_rank_pid(2);
    ASSERT_GT(rank2, 0) << server.log();
    int in_flight = -1;
    for (int request = 0; request < 64 && in_flight < 0; ++request) {
      ASSERT_EQ(run_clients(server.port(), 1, 1, 1).at(0).size(), 1u);
      in_flight = rebalance_in_flight(server.log());
    }
    ASSERT_GE(in_flight, 0) << "no rebalance changed two layers or more: " << server.log();
    ASSERT_EQ(::kill(rank2, SIGKILL), 0);
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew), reference);
    const std::string log = server.log();
    const size_t fault = log.find("elastic: fault detected");
    ASSERT_NE(fault, std::string::npos) << log;
    EXPECT_EQ(log.rfind(fmt::format("rebalance {}: migration complete", in_flight), fault), std::string::npos) << log;
    expect_recovered(server, 1, 3, "2", /*reprefilled=*/false);  // found by the first request's add: none was live
    EXPECT_NE(log.find("129 slots per MoE layer"), std::string::npos) << log;  // re-planned: 132 / 4 x 3 < 128
    // The new world's EPLB (from the re-planned placement, the same on every survivor: each rebalance checks it)
    // rebalances and migrates among the survivors.
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew), reference);
    EXPECT_GE(logged_rebalances(server.log().substr(fault)).size(), 1u) << server.log();
    EXPECT_EQ(server.terminate(), 0) << server.log();
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);
}

// An initial placement (--init-expert-location) over 256 slots (--ep-num-redundant-experts 128), 64 per rank, where
// every expert has two replicas except, in MoE layer l, experts 0..l held by rank 2 alone (their slots on rank 0
// hold extra copies of experts 64..64+l): killing rank 2 loses the last replica of 1 + 2 + 3 + 4 = 10 logical
// experts, which no survivor can send; the recovery reloads them from the checkpoint, the other slots from copies.
TEST(ElasticServe, ExpertsWhoseLastReplicaIsLostAreReloadedFromTheCheckpoint) {
  std::signal(SIGPIPE, SIG_IGN);
  const auto& reference = fault_free();
  TempDir dir("serve_elastic_last_replica");
  constexpr int kExperts = 128, kSlots = 256, kMoeLayers = 4;
  json map = json::array();
  for (int l = 0; l < kMoeLayers; ++l) {
    json row = json::array();
    for (int s = 0; s < kSlots; ++s) row.push_back(s < l + 1 ? kExperts / 2 + s : s % kExperts);
    map.push_back(row);
  }
  const std::string placement = dir.file("placement.json");
  std::ofstream(placement) << json{{"num_gpus", 4}, {"physical_to_logical_map", map}}.dump();
  {
    std::vector<std::string> flags = elastic_flags(dir);
    flags.insert(flags.end(), {"--ep-num-redundant-experts", "128", "--init-expert-location", placement});
    ServerProcess server(skewed_served_model(), flags, dir.file("serve.log"));
    const pid_t rank2 = server.wait_rank_pid(2);
    ASSERT_GT(rank2, 0) << server.log();
    EXPECT_EQ(clients_across(server, [&] { ASSERT_EQ(::kill(rank2, SIGKILL), 0); }), reference);
    expect_recovered(server, 1, 3, "2");
    EXPECT_NE(server.log().find("elastic: 10 logical expert(s) lost their last replica with rank(s) 2 (per MoE layer: "
                                "1, 2, 3, 4); reloaded from the checkpoint"),
              std::string::npos)
        << server.log();
    EXPECT_NE(server.log().find("192 slots per MoE layer"), std::string::npos) << server.log();  // 64 on each survivor
    const std::vector<SlotSources> sources = slot_sources(server.log());
    ASSERT_EQ(sources.size(), 1u) << server.log();
    EXPECT_EQ(sources[0].experts_from_checkpoint, 10) << server.log();  // the others came from survivors' copies
    EXPECT_GE(sources[0].checkpoint, 10);
    EXPECT_EQ(sources[0].total(), 4 * 192);
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew), reference);
    EXPECT_EQ(server.terminate(), 0) << server.log();
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);
}

// The restart command of one rank (`fulcrum serve ... --nnodes N --node-rank R --dist-init-addr HOST:PORT`): a
// process with no HTTP front end (so not a ServerProcess), its output in `log_file`.
std::unique_ptr<CliProcess> restart_rank(const std::vector<std::string>& flags, const std::string& log_file) {
  return std::make_unique<CliProcess>(serve_args(skewed_served_model(), flags), log_file);
}

// Two "nodes" on one host: node 0 (the front end, ranks 0 and 1) and node 1 (ranks 2 and 3), each its own
// `serve ... --nnodes 2 --node-rank N --dist-init-addr` command. Rank 3 killed under 32 clients: node 1's launcher
// reports it and keeps rank 2, the world goes on with ranks 0, 1, 2 and the outputs of the fault-free run; stopping
// the server stops node 1's command too, cleanly (one of its ranks served to the end).
TEST(ElasticServe, ARankKilledOnAnotherNodeLeavesThatNodesOtherRanksServing) {
  std::signal(SIGPIPE, SIG_IGN);
  const auto& reference = fault_free();
  TempDir dir("serve_elastic_two_nodes");
  {
    const std::string address = "127.0.0.1:" + std::to_string(comm::pick_free_port());
    const auto node_flags = [&](const std::string& node) {
      std::vector<std::string> flags = elastic_flags(dir);
      flags.insert(flags.end(), {"--nnodes", "2", "--node-rank", node, "--dist-init-addr", address});
      return flags;
    };
    CliProcess node1(serve_args(skewed_served_model(), node_flags("1")), dir.file("node1.log"));
    ServerProcess server(skewed_served_model(), node_flags("0"), dir.file("serve.log"));
    std::smatch m;
    ASSERT_TRUE(node1.wait_log("rank 3 (pid ")) << node1.log();
    const std::string started = node1.log();
    ASSERT_TRUE(std::regex_search(started, m, std::regex("rank 3 \\(pid ([0-9]+)\\) joined"))) << started;
    const pid_t rank3 = static_cast<pid_t>(std::stol(m[1]));
    EXPECT_EQ(clients_across(server, [&] { ASSERT_EQ(::kill(rank3, SIGKILL), 0); }), reference);
    expect_recovered(server, 1, 3, "3");
    EXPECT_TRUE(node1.wait_log("fulcrum: rank 3 lost: ")) << node1.log();
    EXPECT_NE(server.log().find("new world (epoch 1): ranks 0, 1, 2 of the 4 launched, without rank(s) 3"),
              std::string::npos)
        << server.log();
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew), reference);
    EXPECT_EQ(server.terminate(), 0) << server.log();
    EXPECT_EQ(node1.wait_exit(), 0) << node1.log();
    EXPECT_EQ(count_of(node1.log(), "fulcrum: error: "), 0) << node1.log();
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);
}

// Rank 2's restart command while rank 2 lives is refused in one line. Rank 2 killed under 32 clients, then
// started again with its own command (the launch's flags plus --nnodes 4
// --node-rank 2 --dist-init-addr, the address the log names) while 32 more clients run: it rejoins, world rank 0
// brings it into a world of 4 again (its KV group home, the launch's 128 slots per MoE layer), no request
// fails, every output equals the fault-free run's, and stopping the server stops the restarted rank too.
TEST(ElasticServe, AKilledRankRestartedWithItsCommandRejoins) {
  std::signal(SIGPIPE, SIG_IGN);
  const auto& reference = fault_free();
  TempDir dir("serve_elastic_rejoin");
  {
    ServerProcess server(skewed_served_model(), elastic_flags(dir), dir.file("serve.log"));
    const pid_t rank2 = server.wait_rank_pid(2);
    ASSERT_GT(rank2, 0) << server.log();
    std::smatch m;
    const std::string started = server.log();
    ASSERT_TRUE(std::regex_search(started, m, std::regex("joined the world of 4 at ([0-9.]+:[0-9]+)"))) << started;
    const std::string address = m[1];
    std::vector<std::string> restart = elastic_flags(dir);
    restart.insert(restart.end(), {"--nnodes", "4", "--node-rank", "2", "--dist-init-addr", address});
    {
      const auto too_soon = restart_rank(restart, dir.file("rank2_too_soon.log"));  // rank 2 alive: refused, one line
      EXPECT_EQ(too_soon->wait_exit(), 1) << too_soon->log();
      EXPECT_EQ(count_of(too_soon->log(), "fulcrum: error: "), 1) << too_soon->log();
      EXPECT_NE(too_soon->log().find("rank 2 (from 127.0.0.1) is still in the world: rank 0 has not seen it fail"),
                std::string::npos)
          << too_soon->log();
    }
    EXPECT_EQ(clients_across(server, [&] { ASSERT_EQ(::kill(rank2, SIGKILL), 0); }), reference);
    expect_recovered(server, 1, 3, "2");
    EXPECT_NE(server.log().find("129 slots per MoE layer"), std::string::npos) << server.log();

    std::unique_ptr<CliProcess> rank2_again;
    EXPECT_EQ(clients_across(server,
                             [&] {
                               rank2_again = restart_rank(restart, dir.file("rank2.log"));
                               ASSERT_TRUE(rank2_again->wait_log("rank 2 (pid ")) << rank2_again->log();
                             }),
              reference);
    // Brought in at world rank 0's next call (within those clients, or the next request when they were done).
    EXPECT_EQ(run_clients(server.port(), kClients, 1, kNew), reference);
    ASSERT_NE(rank2_again, nullptr);
    EXPECT_NE(rank2_again->log().find("rejoined the world of 4 at " + address),
              std::string::npos)
        << rank2_again->log();
    const std::string log = server.log();
    const size_t rejoin = log.find("elastic: rank 2 rejoins");
    ASSERT_NE(rejoin, std::string::npos) << log;
    EXPECT_EQ(count_of(log, "elastic: rank 2 rejoins"), 1) << log;
    const std::string after = log.substr(rejoin);
    EXPECT_NE(after.find("new world (epoch 2): ranks 0, 1, 2, 3 of the 4 launched, rank(s) 2 rejoined"), std::string::npos)
        << log;
    EXPECT_NE(after.find("re-planned onto tp 4 (attention: 4 DP group(s) x 1 TP), ep 4"), std::string::npos) << log;
    EXPECT_NE(after.find("128 slots per MoE layer"), std::string::npos) << log;  // the launch's 32 per rank
    EXPECT_NE(after.find("KV groups moved: none"), std::string::npos) << log;   // group 2 is home again
    // The recovery read rank 2's experts from the checkpoint; the rejoin reads none: every expert survived, and
    // the newcomer (holding none) received its 32 slots of each MoE layer.
    const std::vector<SlotSources> sources = slot_sources(log);
    ASSERT_EQ(sources.size(), 2u) << log;
    EXPECT_EQ(sources[0].experts_from_checkpoint, 4 * 32) << log;
    EXPECT_EQ(sources[1].checkpoint, 0) << log;
    EXPECT_EQ(sources[1].experts_from_checkpoint, 0) << log;
    EXPECT_GE(sources[1].received, 4 * 32) << log;
    EXPECT_GT(sources[1].bytes_received, 0) << log;
    EXPECT_EQ(sources[1].total(), 4 * 128) << log;
    EXPECT_EQ(count_of(log, "fulcrum: error: "), 0) << log;
    const std::regex done("elastic: rejoin done in ([0-9.]+) s \\(newcomer taken -> first completed step\\), 4 live rank");
    ASSERT_TRUE(std::regex_search(after, m, done)) << log;
    const std::string seconds = m[1];
    ASSERT_TRUE(std::regex_search(after, m, std::regex("re-prefilling ([0-9]+) request"))) << log;
    std::cout << "[ elastic ] rejoin done in " << seconds << " s, " << m[1] << " live request(s) re-prefilled\n";
    std::map<std::string, double> metric = metrics(server.port());
    EXPECT_EQ(metric["fulcrum_live_ranks"], 4);
    EXPECT_EQ(metric["fulcrum_elastic_recoveries_total"], 1);  // the rejoin is not a recovery
    EXPECT_EQ(server.terminate(), 0) << server.log();
    EXPECT_EQ(rank2_again->wait_exit(), 0) << rank2_again->log();  // world rank 0's stop reached it
  }
  EXPECT_EQ(processes_mentioning(dir.path()), 0);
}

TEST(ElasticServe, UnsupportedLayoutsAreRefusedInOneLine) {
  TempDir dir("serve_elastic_refused");
  const std::string model = "serve --port 0 --model " + skewed_served_model();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --multi-process --enable-elastic-ep --tp 2 --ep 2 --disable-radix-cache",
       "--enable-elastic-ep needs one rank per attention-DP group and per EP rank"},
      {" --enable-elastic-ep --tp 2 --dp 2 --enable-dp-attention --ep 2 --disable-radix-cache",
       "--enable-elastic-ep needs ranks as processes"},
  };
  for (const auto& [flags, error] : cases) {
    const CliRun run = run_cli(dir, model + flags);
    EXPECT_NE(run.exit_code, 0) << flags;
    EXPECT_EQ(count_of(run.err, "fulcrum: error: "), 1) << run.err;
    EXPECT_NE(run.err.find(error), std::string::npos) << flags << ": " << run.err;
  }
}

}  // namespace
}  // namespace fulcrum::test
