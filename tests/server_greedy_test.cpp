// Greedy outputs through the scheduler equal standalone greedy runs, whatever else is in the batch:
// prompts of different lengths submitted concurrently, chunked prefill, a running limit that makes
// requests wait and join mid-flight.
#include <regex>
#include <thread>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "model/generate.hpp"
#include "server/engine_step_executor.hpp"
#include "server/scheduler.hpp"
#include "server_test_util.hpp"

namespace fulcrum::server {
namespace {

std::vector<std::vector<int32_t>> test_prompts(int vocab) {
  std::vector<std::vector<int32_t>> prompts;
  model::Rng rng(11);
  for (const int length : {1, 5, 13, 29, 8, 21}) {
    std::vector<int32_t> p;
    for (int i = 0; i < length; ++i) p.push_back(static_cast<int32_t>(rng.next() % static_cast<uint64_t>(vocab)));
    prompts.push_back(p);
  }
  return prompts;
}

// Staggered requests through the scheduler on `executor` give the standalone single-rank greedy tokens.
void expect_batched_equals_standalone(EngineStepExecutor& executor) {
  const std::string& dir = test::tiny_served_model();
  constexpr int kNew = 6;
  const auto prompts = test_prompts(executor.vocab_size());

  std::vector<std::vector<int32_t>> expected;
  {
    backend::CpuBackend backend;
    model::Qwen3MoeModel solo(executor.config(), backend);
    model::Checkpoint checkpoint(dir);
    solo.load_weights(checkpoint);
    for (const auto& p : prompts) expected.push_back(model::generate_greedy(solo, backend, {p}, kNew).new_tokens[0]);
  }

  Scheduler scheduler(executor, {.max_running_requests = 4, .kv_pages = 64, .page_size = 8, .max_prefill_tokens = 7});
  std::thread loop([&] { scheduler.run(); });
  std::vector<std::shared_ptr<RequestHandle>> handles(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i) {
    clients.emplace_back([&, i] {
      std::this_thread::sleep_for(std::chrono::milliseconds(3 * static_cast<int>(i)));  // staggered arrivals
      RequestParams p;
      p.prompt = prompts[i];
      p.max_tokens = kNew;
      handles[i] = scheduler.submit(p);
    });
  }
  // Sampled requests share the batch; a seeded one gives the same tokens whatever runs beside it.
  const auto sampled = [&] {
    RequestParams p;
    p.prompt = prompts[2];
    p.max_tokens = kNew;
    p.sampling = {.temperature = 0.9f, .top_p = 0.95f, .top_k = 50};
    p.seed = 1234;
    return scheduler.submit(p);
  };
  auto sampled_a = sampled();
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(handles[i]->wait_finished(), expected[i]) << "prompt " << i;
  auto sampled_b = sampled();  // alone in the batch now
  EXPECT_EQ(sampled_a->wait_finished(), sampled_b->wait_finished());
  scheduler.stop();
  loop.join();
  EXPECT_EQ(scheduler.gauges().kv_pages_used, 0);
}

// The executor on the tiny served model (assigned field by field: designated initializers warn under -Wextra).
EngineExecutorOptions tiny_options() {
  EngineExecutorOptions o;
  o.model_dir = test::tiny_served_model();
  return o;
}

TEST(ServerGreedy, BatchedEqualsStandalone) {
  EngineStepExecutor executor(tiny_options());
  expect_batched_equals_standalone(executor);
}

// Sequences join and leave two attention-DP groups of a tp 4 / ep 4 world while EPLB rebalances every
// two passes and migrates slots: the tokens are still the single-rank ones.
TEST(ServerGreedy, ParallelLayoutWithLiveEplbEqualsStandalone) {
  ServerMetrics metrics;
  EngineExecutorOptions options = tiny_options();
  options.metrics = &metrics;
  options.parallel = {.tp = 4, .dp = 2, .ep = 4, .enable_dp_attention = true, .num_redundant_experts = 4};
  options.run.engine.moe_a2a_backend = "alltoall";
  options.run.eplb.enabled = true;
  options.run.eplb.rebalance_num_iterations = 2;
  options.run.eplb.recorder_buffer_size = 4;
  options.run.eplb.skip_balancedness = 1.0;  // replan whenever the planner improves a layer
  std::vector<std::string> lines;
  options.log = [&lines](const std::string& line) { lines.push_back(line); };
  EngineStepExecutor executor(std::move(options));
  EXPECT_EQ(executor.layout().world_size(), 4);
  expect_batched_equals_standalone(executor);
  const std::string text = metrics.render({});
  std::smatch m;
  ASSERT_TRUE(std::regex_search(text, m, std::regex("fulcrum_eplb_rebalances_total ([0-9]+)")));
  EXPECT_GE(std::stoi(m[1]), 1) << text;
  EXPECT_FALSE(lines.empty());
}

TEST(ServerGreedy, RecorderCountsRoutingWhileRecording) {
  EngineStepExecutor executor(tiny_options());
  Scheduler scheduler(executor, {});
  RequestParams p;
  p.prompt = {3, 4, 5};
  p.max_tokens = 2;
  executor.recorder()->start();
  auto h = scheduler.submit(p);
  while (!scheduler.idle()) scheduler.step();
  executor.recorder()->stop();
  scheduler.submit(p);
  while (!scheduler.idle()) scheduler.step();  // not recorded
  const nlohmann::json dump = executor.recorder()->dump("");
  const int top_k = executor.config().num_experts_per_tok;
  ASSERT_EQ(dump["logical_count"].size(), executor.config().moe_layer_indices().size());
  for (const auto& row : dump["logical_count"]) {
    int64_t sum = 0;
    for (const auto& c : row) sum += c.get<int64_t>();
    EXPECT_EQ(sum, 4 * top_k);  // 3 prompt tokens + 1 decode token
  }
  EXPECT_EQ(dump["num_tokens"], 4);
}

}  // namespace
}  // namespace fulcrum::server
