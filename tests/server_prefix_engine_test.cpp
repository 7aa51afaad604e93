// Prefix caching on the CPU engine: greedy outputs through the scheduler are bitwise the same with and
// without the cache (attention sums in position order over the page table, so a sequence reading another's
// pages computes exactly what it would have computed itself, and so does one reading rows copied from a
// partly shared page), on one rank, on two attention-DP groups, and while EPLB rebalances.
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
  // 21 and 13 tokens end inside pages of 4; the third leaves the first inside its page 3 (copied rows).
  std::vector<std::vector<int32_t>> prefixes = {draw(21), draw(13)};
  prefixes.push_back(std::vector<int32_t>(prefixes[0].begin(), prefixes[0].begin() + 14));
  for (const int32_t t : draw(4)) prefixes.back().push_back(t);
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

// The executor, counting the allocations that copy a partly shared page's rows.
class CopyCounter final : public StepExecutor {
 public:
  explicit CopyCounter(StepExecutor& inner) : inner_(inner) {}
  int vocab_size() const override { return inner_.vocab_size(); }
  int64_t max_sequence_length() const override { return inner_.max_sequence_length(); }
  void allocate(SequenceId id, int64_t capacity) override { inner_.allocate(id, capacity); }
  void allocate_on_pages(SequenceId id, const model::SequencePages& pages) override {
    if (pages.copy_source_page >= 0) ++copies;
    inner_.allocate_on_pages(id, pages);
  }
  int num_kv_groups() const override { return inner_.num_kv_groups(); }
  void release(SequenceId id) override { inner_.release(id); }
  model::StepOutput step(std::span<const model::StepSequence> batch) override { return inner_.step(batch); }
  bool supports_prompt_logprobs() const override { return inner_.supports_prompt_logprobs(); }
  int copies = 0;

 private:
  StepExecutor& inner_;
};

// Submits the requests in two waves (the second finds the first's pages cached) and runs them to the end.
std::vector<std::vector<int32_t>> run(EngineStepExecutor& engine, const std::vector<RequestParams>& requests,
                                      bool prefix_cache, QueueGauges& gauges, int* copies = nullptr) {
  CopyCounter executor(engine);
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
  if (copies != nullptr) *copies = executor.copies;
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
  int copies = 0;
  const auto with = run(executor, requests, true, with_gauges, &copies);
  const auto without = run(executor, requests, false, without_gauges);
  EXPECT_EQ(with, without);
  EXPECT_GT(with_gauges.prefix_cache_hit_tokens, 0);
  EXPECT_GT(copies, 0);  // some sequences read rows copied from a partly shared page
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
