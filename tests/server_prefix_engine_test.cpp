// Prefix caching on the CPU engine: greedy outputs through the scheduler are bitwise the same with and
// without the cache (attention sums in position order over the page table, so a sequence reading another's
// pages computes exactly what it would have computed itself), on one rank, on two attention-DP groups, and while
// EPLB rebalances.
#include <regex>
#include <string>

#include <gtest/gtest.h>

#include "model/rng.hpp"
#include "server/engine_step_executor.hpp"
#include "server/metrics.hpp"
#include "server/scheduler.hpp"
#include "server_test_util.hpp"

namespace fulcrum::server {
namespace {

std::vector<RequestParams> shared_prefix_requests(int vocab, uint64_t seed) {
  model::Rng rng(seed);
  const auto draw = [&](int n) {
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) out.push_back(static_cast<int32_t>(rng.next() % static_cast<uint64_t>(vocab)));
    return out;
  };
  const std::vector<std::vector<int32_t>> prefixes = {draw(21), draw(13)};
  std::vector<RequestParams> requests;
  for (int i = 0; i < 12; ++i) {
    RequestParams p;
    p.prompt = prefixes[rng.next() % prefixes.size()];
    const std::vector<int32_t> suffix = draw(static_cast<int>(rng.next() % 6));
    p.prompt.insert(p.prompt.end(), suffix.begin(), suffix.end());
    p.max_tokens = 2 + static_cast<int>(rng.next() % 5);
    requests.push_back(p);
  }
  return requests;
}

// Submits the requests in two waves (the second finds the first's pages cached) and runs them to the end.
std::vector<std::vector<int32_t>> run(EngineStepExecutor& executor, const std::vector<RequestParams>& requests,
                                      bool prefix_cache, QueueGauges& gauges) {
  Scheduler s(executor, {.max_running_requests = 4, .kv_pages = 48, .page_size = 4, .max_prefill_tokens = 7,
                         .prefix_cache = prefix_cache});
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (size_t i = 0; i < requests.size(); ++i) {
    handles.push_back(s.submit(requests[i]));
    if (i == requests.size() / 2) {
      while (!s.idle()) s.step();
    }
  }
  while (!s.idle()) s.step();
  std::vector<std::vector<int32_t>> out;
  for (auto& h : handles) {
    EXPECT_EQ(h->finish_reason(), FinishReason::kLength);
    out.push_back(h->wait_finished());
  }
  gauges = s.gauges();
  EXPECT_EQ(gauges.kv_pages_used, 0);
  return out;
}

// Returns the executor's metrics text after both runs (EPLB gauges when it rebalanced).
std::string expect_cache_changes_nothing(EngineExecutorOptions options) {
  ServerMetrics metrics;
  options.metrics = &metrics;
  options.model_dir = test::tiny_served_model();
  options.kv_pages = 48;
  options.page_size = 4;
  EngineStepExecutor executor(std::move(options));
  const std::vector<RequestParams> requests = shared_prefix_requests(executor.vocab_size(), 3);
  QueueGauges with_gauges, without_gauges;
  const auto with = run(executor, requests, true, with_gauges);
  const auto without = run(executor, requests, false, without_gauges);
  EXPECT_EQ(with, without);
  EXPECT_GT(with_gauges.prefix_cache_hit_tokens, 0);
  EXPECT_EQ(without_gauges.prefix_cache_hit_tokens, 0);
  return metrics.render({});
}

TEST(ServerPrefixEngine, GreedyOutputsEqualWithAndWithoutTheCacheOnOneRank) {
  expect_cache_changes_nothing({});
}

TEST(ServerPrefixEngine, GreedyOutputsEqualWithAndWithoutTheCacheOnTwoDpGroups) {
  EngineExecutorOptions options;
  options.parallel = {.tp = 2, .dp = 2, .ep = 2, .enable_dp_attention = true};
  expect_cache_changes_nothing(std::move(options));
}

// Live EPLB rebalancing every two passes while sequences read cached pages: experts move, the KV pages do not,
// and the tokens stay those of the run without the cache.
TEST(ServerPrefixEngine, GreedyOutputsEqualAcrossLiveEplbRebalances) {
  EngineExecutorOptions options;
  test::set_live_eplb_layout(options);
  options.log = [](const std::string&) {};
  const std::string text = expect_cache_changes_nothing(std::move(options));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(text, m, std::regex("fulcrum_eplb_rebalances_total ([0-9]+)")));
  EXPECT_GE(std::stoi(m[1]), 1) << text;
}

}  // namespace
}  // namespace fulcrum::server
