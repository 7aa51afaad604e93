// `fulcrum serve` on the parallel engine with live EPLB: real server processes on loopback, a tiny
// synthetic model whose routers follow a real Qwen3-30B-A3B load matrix, concurrent streaming and
// non-streaming clients. Rebalances happen during the load (log and /metrics) and no response changes:
// every greedy response equals `fulcrum generate` on the same layout without EPLB. Then the seeds'
// scenario (SGLang's Qwen3 EPLB launch, scaled to this machine) and a 2-minute soak.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "server/load_generator.hpp"
#include "server_clients.hpp"
#include "server_http_util.hpp"
#include "server_process.hpp"
#include "server_test_util.hpp"

namespace fulcrum::test {
namespace {

TEST(ServerEplb, ConcurrentClientsDuringRebalancesMatchGenerate) {
  std::signal(SIGPIPE, SIG_IGN);
  const std::string layout = "--tp 4 --ep 4 --moe-a2a-backend alltoall --ep-num-redundant-experts 8";
  TempDir dir("serve_eplb");
  std::vector<std::string> flags = {"--enable-eplb", "--eplb-rebalance-num-iterations", "4",
                                    "--expert-distribution-recorder-buffer-size", "8", "--max-running-requests", "16",
                                    "--kv-pages", "256", "--page-size", "8", "--expert-distribution-dir", dir.path()};
  std::istringstream words(layout);
  for (std::string w; words >> w;) flags.push_back(w);
  ServerProcess server(skewed_served_model(), flags, dir.file("serve.log"));
  // 4 layers on each of the 4 ranks of the stage, counted as they load.
  EXPECT_NE(server.log().find("loading weights [##############################] 16/16 layers"), std::string::npos)
      << server.log();
  ASSERT_EQ(post(server.port(), "/start_expert_distribution_record", "").first, 200);

  constexpr int kClients = 16, kRequests = 2, kNew = 10;
  const auto got = run_clients(server.port(), kClients, kRequests, kNew);
  const auto prompts = all_prompts(kClients, kRequests);
  EXPECT_EQ(got, generate_greedy(skewed_served_model(), layout, prompts, kNew));

  // The recorder of the endpoints counted every token once, over all ranks: a prompt is prefilled and
  // each request runs kNew - 1 decode steps (its last token is sampled, never fed).
  ASSERT_EQ(post(server.port(), "/stop_expert_distribution_record", "").first, 200);
  const auto [status, dump] = post(server.port(), "/dump_expert_distribution_record", R"({"name": "dist.json"})");
  ASSERT_EQ(status, 200) << dump.dump();
  int64_t tokens = 0;
  for (const auto& p : prompts) tokens += static_cast<int64_t>(p.size()) + kNew - 1;
  EXPECT_EQ(dump["num_tokens"], tokens);
  ASSERT_EQ(dump["logical_count"].size(), 4u);
  for (const auto& row : dump["logical_count"]) {
    int64_t sum = 0;
    for (const auto& v : row) sum += v.get<int64_t>();
    EXPECT_EQ(sum, 8 * tokens);
  }
  const CliRun plan = run_cli(dir, "plan --loads " + dir.file("dist.json") + " --gpus 4 --physical-experts 136 --json");
  EXPECT_EQ(plan.exit_code, 0) << plan.err;

  std::map<std::string, double> m = metrics(server.port());
  EXPECT_GE(m["fulcrum_eplb_rebalances_total"], 1);
  EXPECT_GT(m["fulcrum_eplb_bytes_migrated_total"], 0);
  EXPECT_TRUE(std::isfinite(m["fulcrum_eplb_balancedness_mean"]));
  EXPECT_TRUE(m.contains("fulcrum_eplb_balancedness{layer=\"3\"}"));
  EXPECT_EQ(m["fulcrum_kv_pages_used"], 0);
  const auto rebalances = logged_rebalances(server.log());
  ASSERT_GE(rebalances.size(), 1u) << server.log();
  EXPECT_GT(rebalances[0].second, rebalances[0].first);
  EXPECT_NE(server.log().find("migration complete after"), std::string::npos) << server.log();
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// serve checks the engine flags as generate does: an impossible layout or a bad EPLB value is a one-line
// error and a non-zero exit before anything listens; EPLB on one EP rank is turned off with a warning.
TEST(ServerEplb, EngineFlagsAreCheckedLikeGenerates) {
  TempDir dir("serve_flags");
  const std::string serve = "serve --model " + skewed_served_model() + " --port 0 ";
  for (const auto& [flags, needle] : std::vector<std::pair<std::string, std::string>>{
           {"--tp 4 --dp 2 --enable-dp-attention --ep 8", "--ep 8 exceeds --tp 4: --tp is the ranks of a stage"},
           {"--tp 2 --ep 2 --ep-num-redundant-experts 3", "not divisible by --ep 2"},
           {"--tp 2 --ep 2 --enable-eplb --eplb-rebalance-num-iterations 0", "--eplb-rebalance-num-iterations"},
           {"--expert-distribution-recorder-mode per_layer", "per_layer"},
           {"--load-format dummy", "--load-format dummy needs the GPU engine"}}) {
    const CliRun run = run_cli(dir, serve + flags);
    EXPECT_NE(run.exit_code, 0) << flags;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
    EXPECT_NE(run.err.find(needle), std::string::npos) << run.err;
    EXPECT_EQ(run.err.find("listening"), std::string::npos) << run.err;
  }
  ServerProcess one_rank(skewed_served_model(), {"--enable-eplb"}, dir.file("serve.log"));
  EXPECT_NE(one_rank.log().find("warning: --enable-eplb: EPLB disabled: a single EP rank"), std::string::npos)
      << one_rank.log();
  EXPECT_EQ(one_rank.terminate(), 0) << one_rank.log();
}

// One rank failing while the world loads (a corrupt weight cache of rank 1, the others waiting in a
// collective) ends the process with that rank's one-line error instead of hanging it.
TEST(ServerEplb, ARankThatFailsWhileLoadingIsAOneLineErrorNotAHang) {
  TempDir dir("serve_rank_failure");
  std::filesystem::create_directories(dir.file("cache"));
  { std::ofstream(dir.file("cache/rank1.safetensors")) << "not a safetensors file"; }
  const CliRun run = run_cli(dir, "serve --model " + skewed_served_model() +
                                      " --port 0 --tp 2 --ep 2 --enable-eplb --weight-cache " + dir.file("cache"));
  EXPECT_EQ(run.exit_code, 1) << run.err;
  const size_t last_line = run.err.rfind('\n', run.err.size() - 2);
  const std::string error = run.err.substr(last_line == std::string::npos ? 0 : last_line + 1);
  EXPECT_TRUE(error.starts_with("fulcrum: error: ")) << run.err;
  EXPECT_NE(error.find("rank1.safetensors"), std::string::npos) << run.err;
  EXPECT_EQ(run.err.find("listening"), std::string::npos) << run.err;
}

// The seeds' scenario (--tp 8 --dp 2 --enable-dp-attention --ep 8 --moe-a2a-backend alltoall --enable-eplb
// --expert-distribution-recorder-buffer-size 50 --expert-distribution-recorder-mode stat
// --eplb-rebalance-num-iterations 50 --ep-dispatch-algorithm static --ep-num-redundant-experts 8; the seed's own
// launch line verbatim is server_seed_lines_test.cpp) on the tiny skewed model: 8 ranks, 2 attention-DP groups of 4, ep 8 over all-to-all dispatch (DeepEP's role), 136 slots
// (17 per EP rank), 64 parallel clients.
TEST(ServerEplb, SeedScenarioRebalancesUnderSixtyFourClientsAndKeepsEveryResponse) {
  std::signal(SIGPIPE, SIG_IGN);
  const std::string layout =
      "--tp 8 --dp 2 --enable-dp-attention --ep 8 --moe-a2a-backend alltoall --ep-dispatch-algorithm static "
      "--ep-num-redundant-experts 8";
  TempDir dir("serve_seed");
  std::vector<std::string> flags = {"--enable-eplb", "--expert-distribution-recorder-buffer-size", "50",
                                    "--expert-distribution-recorder-mode", "stat", "--eplb-rebalance-num-iterations",
                                    "50", "--max-running-requests", "64", "--kv-pages", "512", "--page-size", "8"};
  std::istringstream words(layout);
  for (std::string w; words >> w;) flags.push_back(w);
  ServerProcess server(skewed_served_model(), flags, dir.file("serve.log"));

  constexpr int kClients = 64, kRequests = 4, kNew = 16;
  const auto expected = generate_greedy(skewed_served_model(), layout, all_prompts(kClients, kRequests), kNew);
  // First 8 requests at once: at least 16 passes (one gauge refresh), fewer than 50 (no rebalance yet).
  const auto first = run_clients(server.port(), 8, 1, kNew);
  for (int c = 0; c < 8; ++c) EXPECT_EQ(first[c], expected[static_cast<size_t>(c * kRequests)]) << "client " << c;
  std::map<std::string, double> initial = metrics(server.port());
  ASSERT_EQ(initial["fulcrum_eplb_rebalances_total"], 0);
  const double before_first_rebalance = initial["fulcrum_eplb_balancedness_mean"];
  ASSERT_TRUE(std::isfinite(before_first_rebalance));
  EXPECT_EQ(run_clients(server.port(), kClients, kRequests, kNew), expected);

  const std::map<std::string, double> m = metrics(server.port());
  const auto rebalances = logged_rebalances(server.log());
  ASSERT_GE(rebalances.size(), 1u) << server.log();
  for (const auto& [before, after] : rebalances) EXPECT_GT(after, before);
  EXPECT_GE(m.at("fulcrum_eplb_rebalances_total"), 1);
  EXPECT_GT(m.at("fulcrum_eplb_balancedness_mean"), before_first_rebalance);
  std::printf("seed scenario: %zu rebalance(s) logged, first %.4f -> %.4f; /metrics balancedness mean %.4f before "
              "the first rebalance, %.4f at the end\n",
              rebalances.size(), rebalances[0].first, rebalances[0].second, before_first_rebalance,
              m.at("fulcrum_eplb_balancedness_mean"));
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

// Two minutes at 32 closed-loop streaming clients on a parallel layout with live EPLB: no failed request,
// every page back, and the server's resident memory at the end within a bound of where it was once the
// load had warmed it up (the KV pool plus allocator slack; nothing may grow with the number of requests).
TEST(ServerEplb, TwoMinuteSoakAtThirtyTwoClientsHasNoErrorsAndNoMemoryGrowth) {
  std::signal(SIGPIPE, SIG_IGN);
  TempDir dir("serve_soak");
  ServerProcess server(skewed_served_model(),
                       {"--tp", "2", "--ep", "2", "--ep-num-redundant-experts", "2", "--enable-eplb",
                        "--eplb-rebalance-num-iterations", "64", "--expert-distribution-recorder-buffer-size", "64",
                        "--max-running-requests", "32", "--kv-pages", "256", "--page-size", "8"},
                       dir.file("serve.log"));
  server::LoadOptions o;
  o.url = server.url();
  o.clients = 32;
  o.prompt_min = 4;
  o.prompt_max = 40;
  o.max_tokens = 16;
  o.duration_s = 5;  // warm-up: every thread, arena and cache the load needs exists afterwards
  const server::LoadReport warm = server::run_load(o);
  EXPECT_EQ(warm.failed, 0) << server::format_load_report(o, warm);
  const int64_t rss_start = server.rss_kib();
  o.duration_s = 120;
  o.seed = 2;
  const server::LoadReport r = server::run_load(o);
  const int64_t rss_end = server.rss_kib();
  EXPECT_EQ(r.failed, 0) << server::format_load_report(o, r);
  EXPECT_GT(r.succeeded, 100);
  EXPECT_EQ(r.output_tokens, int64_t{16} * r.succeeded);
  const std::map<std::string, double> m = metrics(server.port());
  EXPECT_EQ(m.at("fulcrum_kv_pages_used"), 0);
  EXPECT_EQ(m.at("fulcrum_requests_running"), 0);
  // KV pool: 256 pages x 8 positions x 4 layers x K and V x 2 kv heads x 16 dims x 4 bytes = 2 MiB (each
  // rank holds at most all of it); allocator slack 32 MiB.
  const int64_t pool_kib = int64_t{256} * 8 * 4 * 2 * 2 * 16 * 4 / 1024 * 2;
  std::printf("soak: %lld requests, RSS %lld KiB after warm-up -> %lld KiB after 120 s (+%lld KiB)\n",
              static_cast<long long>(r.succeeded), static_cast<long long>(rss_start), static_cast<long long>(rss_end),
              static_cast<long long>(rss_end - rss_start));
  EXPECT_LE(rss_end - rss_start, pool_kib + 32 * 1024);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

}  // namespace
}  // namespace fulcrum::test
