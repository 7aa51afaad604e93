// Greedy outputs through the scheduler equal standalone greedy runs, whatever else is in the batch:
// prompts of different lengths submitted concurrently, chunked prefill, a running limit that makes
// requests wait and join mid-flight.
#include <cmath>
#include <regex>
#include <thread>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "model/generate.hpp"
#include "model/step_model.hpp"
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

// What the scheduler computed before the step interface sampled (model::sample_token on the last-position
// logits with the request's Rng(seed)), on the standalone single-rank model, one sequence alone.
std::vector<int32_t> standalone_sampled(model::Qwen3MoeModel& solo, backend::CpuBackend& backend,
                                        const std::vector<int32_t>& prompt, int num_new,
                                        const model::SamplingParams& sampling, uint64_t seed) {
  model::Rng rng(seed);
  model::KvCache cache = solo.create_kv_cache(static_cast<int64_t>(prompt.size()) + num_new);
  std::vector<int32_t> out;
  std::vector<int32_t> new_tokens = prompt;
  for (int i = 0; i < num_new; ++i) {
    const model::SequenceInput in{new_tokens, &cache};
    const std::vector<float> logits = backend.download(solo.forward(std::span(&in, 1))[0]);  // [n, vocab]
    out.push_back(model::sample_token(std::span<const float>(logits).last(static_cast<size_t>(solo.config().vocab_size)),
                                      sampling, rng));
    new_tokens = {out.back()};
  }
  return out;
}

// Staggered requests through the scheduler on `executor` give the standalone single-rank greedy tokens,
// and a seeded sampled request the standalone sample_token draws with its seed.
void expect_batched_equals_standalone(EngineStepExecutor& executor) {
  const std::string& dir = test::tiny_served_model();
  constexpr int kNew = 6;
  const auto prompts = test_prompts(executor.vocab_size());

  const model::SamplingParams sampling{.temperature = 0.9f, .top_p = 0.95f, .top_k = 50};
  constexpr uint64_t kSeed = 1234;
  std::vector<std::vector<int32_t>> expected;
  std::vector<int32_t> expected_sampled;
  {
    backend::CpuBackend backend;
    model::Qwen3MoeModel solo(executor.config(), backend);
    model::Checkpoint checkpoint(dir);
    solo.load_weights(checkpoint);
    for (const auto& p : prompts) expected.push_back(model::generate_greedy(solo, backend, {p}, kNew).new_tokens[0]);
    expected_sampled = standalone_sampled(solo, backend, prompts[2], kNew, sampling, kSeed);
  }
  EXPECT_NE(expected_sampled, expected[2]) << "the draws never left the argmax: the sampled check shows nothing";

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
    p.sampling = sampling;
    p.seed = kSeed;
    return scheduler.submit(p);
  };
  auto sampled_a = sampled();
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(handles[i]->wait_finished(), expected[i]) << "prompt " << i;
  auto sampled_b = sampled();  // alone in the batch now
  EXPECT_EQ(sampled_a->wait_finished(), expected_sampled);
  EXPECT_EQ(sampled_b->wait_finished(), expected_sampled);
  scheduler.stop();
  loop.join();
  EXPECT_EQ(scheduler.gauges().kv_pages_used, 0);
}

// The executor on the tiny served model (assigned field by field: designated initializers warn under -Wextra).
EngineExecutorOptions tiny_options() {
  EngineExecutorOptions o;
  o.model_dir = test::tiny_served_model();
  o.kv_pages = 64;  // the scheduler's pool below
  o.page_size = 8;
  return o;
}

TEST(ServerGreedy, BatchedEqualsStandalone) {
  EngineStepExecutor executor(tiny_options());
  expect_batched_equals_standalone(executor);
}

// step() samples exactly the entries that ask, from the last-position logits of each: a greedy entry with
// its logprob, a non-final prompt chunk (nothing sampled), then that prompt's last chunk at temperature > 0
// with a given uniform; compared with the standalone model's prompt logits.
TEST(ServerGreedy, EngineStepSamplesOnlyTheEntriesThatAsk) {
  EngineStepExecutor executor(tiny_options());
  const auto prompts = test_prompts(executor.vocab_size());
  const std::vector<int32_t>& short_prompt = prompts[1];  // 5 tokens
  const std::vector<int32_t>& long_prompt = prompts[2];   // 13 tokens
  std::vector<std::vector<float>> last_logits;            // per prompt: [vocab_size]
  {
    backend::CpuBackend backend;
    model::Qwen3MoeModel solo(executor.config(), backend);
    model::Checkpoint checkpoint(test::tiny_served_model());
    solo.load_weights(checkpoint);
    for (const auto& p : {short_prompt, long_prompt}) {
      const model::HostTensor logits = model::generate_greedy(solo, backend, {p}, 1).prompt_logits[0];
      last_logits.push_back(std::vector<float>(logits.data.end() - executor.vocab_size(), logits.data.end()));
    }
  }
  executor.allocate(1, 16);
  executor.allocate(2, 16);
  std::vector<model::StepSequence> batch(2);
  batch[0].id = 1;
  batch[0].token_ids = short_prompt;
  batch[0].sample = true;
  batch[0].want_logprob = true;
  batch[1].id = 2;
  batch[1].token_ids = std::span<const int32_t>(long_prompt).first(8);
  batch[1].want_logprob = true;  // ignored: nothing is sampled
  model::StepOutput out = executor.step(batch);
  ASSERT_EQ(out.tokens.size(), 2u);
  EXPECT_EQ(out.tokens[0], model::argmax(last_logits[0]));
  EXPECT_NEAR(out.logprobs[0], model::token_logprob(last_logits[0], out.tokens[0]), 1e-4);
  EXPECT_LE(out.logprobs[0], 0.0f);
  EXPECT_EQ(out.tokens[1], -1);
  EXPECT_TRUE(std::isnan(out.logprobs[1]));
  EXPECT_TRUE(out.errors[0].empty() && out.errors[1].empty());

  model::StepSequence rest;
  rest.id = 2;
  rest.token_ids = std::span<const int32_t>(long_prompt).subspan(8);
  rest.sample = true;
  rest.sampling = {.temperature = 0.8f, .top_p = 0.9f, .top_k = 20};
  rest.uniform = 0.37;
  out = executor.step(std::span<const model::StepSequence>(&rest, 1));
  ASSERT_EQ(out.tokens.size(), 1u);
  EXPECT_EQ(out.tokens[0], model::sample_token_from_uniform(last_logits[1], rest.sampling, rest.uniform));
  EXPECT_TRUE(std::isnan(out.logprobs[0]));
  executor.release(1);
  executor.release(2);
}

// Sequences join and leave two attention-DP groups of a tp 4 / ep 4 world while EPLB rebalances every
// two passes and migrates slots: the tokens are still the single-rank ones.
TEST(ServerGreedy, ParallelLayoutWithLiveEplbEqualsStandalone) {
  ServerMetrics metrics;
  EngineExecutorOptions options = tiny_options();
  options.metrics = &metrics;
  test::set_live_eplb_layout(options);
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
  Scheduler scheduler(executor, {.kv_pages = 64, .page_size = 8});
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
