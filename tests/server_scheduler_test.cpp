// Scheduler logic over a fake executor: admission control, page accounting, chunked prefill, batch
// composition, which entries sample and with which draws, stop conditions, cancellation.
#include <map>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "model/sampling.hpp"
#include "server/api_error.hpp"
#include "server/scheduler.hpp"
#include "server_test_util.hpp"

namespace fulcrum::server {
namespace {

using test::FakeExecutor;

RequestParams request(std::vector<int32_t> prompt, int max_tokens) {
  RequestParams p;
  p.prompt = std::move(prompt);
  p.max_tokens = max_tokens;
  return p;
}

std::vector<int32_t> iota_prompt(int n, int start = 1) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((start + i) % 50);
  return p;
}

void run_until_idle(Scheduler& s, int max_steps = 10000) {
  for (int i = 0; i < max_steps && !s.idle(); ++i) s.step();
  ASSERT_TRUE(s.idle());
}

TEST(ServerScheduler, AdmissionWaitsForPagesInsteadOfDropping) {
  FakeExecutor exec;
  // Each request needs ceil((6 + 10) / 4) = 4 pages; the pool holds 9: two run, the third waits.
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 9, .page_size = 4, .max_prefill_tokens = 64});
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (int i = 0; i < 3; ++i) handles.push_back(s.submit(request(iota_prompt(6, i), 10)));
  s.step();
  QueueGauges g = s.gauges();
  EXPECT_EQ(g.running, 2);
  EXPECT_EQ(g.waiting, 1);
  EXPECT_EQ(g.kv_pages_used, 8);
  EXPECT_EQ(exec.live.size(), 2u);
  run_until_idle(s);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(handles[i]->finish_reason(), FinishReason::kLength);
    EXPECT_EQ(handles[i]->wait_finished(), FakeExecutor::expected(iota_prompt(6, i), 10, 50)) << i;
  }
  g = s.gauges();
  EXPECT_EQ(g.kv_pages_used, 0);
  EXPECT_TRUE(exec.live.empty());
}

// A request's KV is released before its handle finishes, whatever ends it (length, a stop token, a failed
// step): a client woken by the end of its request must not find the server still holding its pages.
TEST(ServerScheduler, KvIsReleasedBeforeTheClientIsTold) {
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 64, .page_size = 4, .max_prefill_tokens = 64});
  std::map<SequenceId, std::shared_ptr<RequestHandle>> handles;
  std::vector<SequenceId> released_unfinished, released_finished;
  exec.on_release = [&](SequenceId id) {
    (handles.at(id)->finish_reason() == FinishReason::kNone ? released_unfinished : released_finished).push_back(id);
  };
  const auto submit = [&](RequestParams p) {
    auto h = s.submit(std::move(p));
    handles[h->id()] = h;
    return h;
  };
  auto by_length = submit(request(iota_prompt(5), 3));
  RequestParams stopping = request(iota_prompt(4, 7), 10);
  stopping.stop_token_ids = {FakeExecutor::expected(iota_prompt(4, 7), 2, 50)[1]};
  auto by_stop = submit(stopping);
  run_until_idle(s);
  EXPECT_EQ(by_length->finish_reason(), FinishReason::kLength);
  EXPECT_EQ(by_stop->finish_reason(), FinishReason::kStop);
  auto by_error = submit(request(iota_prompt(6, 3), 4));
  s.step();
  exec.fail_next_step = true;
  s.step();
  EXPECT_EQ(by_error->finish_reason(), FinishReason::kError);
  EXPECT_EQ(released_unfinished.size(), 3u);
  EXPECT_TRUE(released_finished.empty()) << "a handle finished before its KV was released";
  EXPECT_EQ(s.gauges().kv_pages_used, 0);
}

TEST(ServerScheduler, RunningLimitAndFifoOrder) {
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 1, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 64});
  auto a = s.submit(request(iota_prompt(3), 2));
  auto b = s.submit(request(iota_prompt(2), 1));
  s.step();
  EXPECT_EQ(s.last_step().entries.size(), 1u);
  EXPECT_EQ(s.last_step().entries[0].id, a->id());
  run_until_idle(s);
  EXPECT_EQ(b->wait_finished().size(), 1u);
}

// An executor without prompt logprobs (an engine that does not implement them) gets a 400 naming them for a
// request that needs prompt rows; SGLang's default logprob_start_len (the last prompt token: no prompt rows) still
// runs there.
TEST(ServerScheduler, PromptLogprobsAreRefusedWhereTheExecutorHasNone) {
  FakeExecutor exec(50, 100);
  exec.prompt_logprobs = false;
  Scheduler s(exec, {.max_running_requests = 4, .kv_pages = 16, .page_size = 4, .max_prefill_tokens = 64});
  RequestParams echo = request(iota_prompt(5), 2);
  echo.logprobs = true;
  echo.prompt_logprobs_from = 1;
  try {
    s.submit(echo);
    FAIL() << "accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_NE(std::string(e.what()).find("prompt logprobs"), std::string::npos) << e.what();
  }
  RequestParams last_only = echo;
  last_only.prompt_logprobs_from = 5;  // = the prompt length
  last_only.top_logprobs = 3;
  auto handle = s.submit(last_only);
  while (!s.idle()) s.step();
  EXPECT_EQ(handle->finish_reason(), FinishReason::kLength);
  EXPECT_TRUE(handle->prompt_logprobs().empty());
  EXPECT_EQ(handle->logprobs().size(), 2u);  // one per generated token
  RequestParams too_many = last_only;
  too_many.top_logprobs = model::kMaxTopLogprobs + 1;
  EXPECT_THROW(s.submit(too_many), ApiError);
}

TEST(ServerScheduler, OversizedPromptIsRefused) {
  FakeExecutor exec(50, 100);
  Scheduler s(exec, {.max_running_requests = 4, .kv_pages = 4, .page_size = 4, .max_prefill_tokens = 64});
  try {
    s.submit(request(iota_prompt(15), 2));  // 17 tokens: 5 pages > 4
    FAIL() << "accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_NE(std::string(e.what()).find("KV pages"), std::string::npos) << e.what();
  }
  EXPECT_THROW(s.submit(request({}, 2)), ApiError);
  EXPECT_THROW(s.submit(request({50}, 2)), ApiError);  // outside the vocabulary
  EXPECT_THROW(s.submit(request({1}, 0)), ApiError);
  EXPECT_TRUE(s.idle());
  // A request that fits the pool exactly runs.
  auto ok = s.submit(request(iota_prompt(14), 2));
  run_until_idle(s);
  EXPECT_EQ(ok->wait_finished().size(), 2u);
}

TEST(ServerScheduler, ChunkedPrefillRespectsTheBudget) {
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 5});
  auto a = s.submit(request(iota_prompt(12), 3));
  auto b = s.submit(request(iota_prompt(7, 3), 3));
  int steps = 0;
  while (!s.idle()) {
    s.step();
    ++steps;
    EXPECT_LE(s.last_step().prefill_tokens, 5);
  }
  EXPECT_EQ(a->wait_finished(), FakeExecutor::expected(iota_prompt(12), 3, 50));
  EXPECT_EQ(b->wait_finished(), FakeExecutor::expected(iota_prompt(7, 3), 3, 50));
  EXPECT_GE(steps, (12 + 7 + 4) / 5);
}

TEST(ServerScheduler, BatchCompositionChangesEveryStep) {
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 64});
  auto a = s.submit(request(iota_prompt(4), 3));
  s.step();  // a: prefill (and its first token)
  ASSERT_EQ(s.last_step().entries.size(), 1u);
  EXPECT_TRUE(s.last_step().entries[0].prefill);
  auto b = s.submit(request(iota_prompt(5, 9), 2));
  s.step();  // a decodes while b joins with its prefill
  ASSERT_EQ(s.last_step().entries.size(), 2u);
  EXPECT_EQ(s.last_step().entries[0].id, a->id());
  EXPECT_FALSE(s.last_step().entries[0].prefill);
  EXPECT_EQ(s.last_step().entries[1].id, b->id());
  EXPECT_TRUE(s.last_step().entries[1].prefill);
  s.step();  // a's third token: a leaves; b decodes
  EXPECT_EQ(a->finish_reason(), FinishReason::kLength);
  EXPECT_EQ(b->finish_reason(), FinishReason::kLength);
  s.step();
  EXPECT_TRUE(s.last_step().entries.empty());
  EXPECT_TRUE(s.idle());
}

// Every decode samples; a prompt chunk samples only when it completes its prompt.
TEST(ServerScheduler, OnlyEntriesThatCompleteTheirPromptSample) {
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 5});
  auto a = s.submit(request(iota_prompt(12), 3));  // chunks 5, 5, 2
  auto b = s.submit(request(iota_prompt(1, 9), 2));  // one token: its only chunk is its last
  run_until_idle(s);
  EXPECT_EQ(a->wait_finished(), FakeExecutor::expected(iota_prompt(12), 3, 50));
  EXPECT_EQ(b->wait_finished(), FakeExecutor::expected(iota_prompt(1, 9), 2, 50));
  std::map<SequenceId, std::vector<std::pair<int, bool>>> seen;  // per sequence: (tokens, sample) per step
  for (const auto& step : exec.steps_seen) {
    for (const FakeExecutor::SeenEntry& e : step) seen[e.id].push_back({e.num_tokens, e.sample});
  }
  using Entries = std::vector<std::pair<int, bool>>;
  EXPECT_EQ(seen[a->id()], (Entries{{5, false}, {5, false}, {2, true}, {1, true}, {1, true}}));
  EXPECT_EQ(seen[b->id()], (Entries{{1, true}, {1, true}}));
}

// Uniforms come from each request's own Rng, one per sampled token, and only at temperature > 0: two
// requests with the same seed, one greedy, one sampled through a chunked prompt, get the tokens of
// sample_token run alone with that seed.
TEST(ServerScheduler, UniformsAreDrawnOnlyForSampledTokensAtPositiveTemperature) {
  constexpr uint64_t kSeed = 2024;
  constexpr int kNew = 8;
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 4});
  RequestParams greedy = request(iota_prompt(9), kNew);
  greedy.seed = kSeed;
  RequestParams sampled = greedy;
  sampled.sampling = {.temperature = 1.0f, .top_p = 1.0f, .top_k = 0};
  auto g = s.submit(greedy);
  auto t = s.submit(sampled);
  run_until_idle(s);

  // The sampled request alone: the fake model's logits after its history, sample_token with Rng(kSeed).
  std::vector<int32_t> expected;
  std::vector<double> expected_uniforms;
  {
    model::Rng rng(kSeed), copy(kSeed);
    std::vector<int32_t> history = sampled.prompt;
    for (int i = 0; i < kNew; ++i) {
      expected.push_back(model::sample_token(FakeExecutor::logits(history, 50), sampled.sampling, rng));
      history.push_back(expected.back());
      expected_uniforms.push_back(copy.uniform());
    }
  }
  EXPECT_EQ(g->wait_finished(), FakeExecutor::expected(iota_prompt(9), kNew, 50));
  EXPECT_EQ(t->wait_finished(), expected);
  EXPECT_NE(expected, FakeExecutor::expected(iota_prompt(9), kNew, 50)) << "the draws show nothing";

  std::vector<double> uniforms;  // of the sampled request's sampling entries, in order
  for (const auto& step : exec.steps_seen) {
    for (const FakeExecutor::SeenEntry& e : step) {
      if (e.id == t->id() && e.sample) {
        EXPECT_EQ(e.temperature, 1.0f);
        uniforms.push_back(e.uniform);
      } else {
        EXPECT_EQ(e.uniform, 0.0) << "a draw for sequence " << e.id << " (sample " << e.sample << ")";
      }
    }
  }
  EXPECT_EQ(uniforms, expected_uniforms);
}

// A sampling failure of one entry (NaN logits) ends that request with "error" and a line on stderr; the
// requests beside it in the batch go on.
TEST(ServerScheduler, AnEntryThatCannotSampleEndsOnlyItsRequest) {
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 64});
  auto a = s.submit(request(iota_prompt(4), 5));
  auto b = s.submit(request(iota_prompt(6, 2), 5));
  auto c = s.submit(request(iota_prompt(3, 5), 5));
  exec.nan_logits = {b->id()};
  testing::internal::CaptureStderr();
  s.step();  // the three prompts in one batch
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, fmt::format("fulcrum serve: request {} failed: sampling: logit of token 3 is nan\n", b->id()));
  EXPECT_EQ(b->finish_reason(), FinishReason::kError);
  EXPECT_TRUE(b->wait_finished().empty());
  EXPECT_FALSE(exec.live.contains(b->id()));
  EXPECT_EQ(s.gauges().running, 2);
  run_until_idle(s);
  EXPECT_EQ(a->wait_finished(), FakeExecutor::expected(iota_prompt(4), 5, 50));
  EXPECT_EQ(c->wait_finished(), FakeExecutor::expected(iota_prompt(3, 5), 5, 50));
  EXPECT_EQ(s.gauges().kv_pages_used, 0);
}

TEST(ServerScheduler, StopTokenIdsEndWithoutTheToken) {
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 64});
  const std::vector<int32_t> full = FakeExecutor::expected(iota_prompt(5), 8, 50);
  RequestParams p = request(iota_prompt(5), 8);
  p.stop_token_ids = {full[3]};
  const auto first = std::find(full.begin(), full.end(), full[3]);
  auto h = s.submit(p);
  run_until_idle(s);
  EXPECT_EQ(h->finish_reason(), FinishReason::kStop);
  EXPECT_EQ(h->wait_finished(), std::vector<int32_t>(full.begin(), first));
}

TEST(ServerScheduler, StopStringsCutTheText) {
  FakeExecutor exec;
  // Token t reads as the letter 'a' + t % 26.
  const Detokenizer detok = [](std::span<const int32_t> ids) {
    std::string text;
    for (const int32_t t : ids) text += static_cast<char>('a' + t % 26);
    return text;
  };
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 64}, detok);
  const std::vector<int32_t> full = FakeExecutor::expected(iota_prompt(5), 8, 50);
  const std::string text = detok(full);
  RequestParams p = request(iota_prompt(5), 8);
  p.stop = {text.substr(3, 2)};
  auto h = s.submit(p);
  run_until_idle(s);
  EXPECT_EQ(h->finish_reason(), FinishReason::kStop);
  const size_t at = text.find(p.stop[0]);
  EXPECT_EQ(h->stop_text_length(), at);
  EXPECT_EQ(h->wait_finished().size(), at + 2);  // tokens through the one completing the stop string
  // Without a detokenizer, stop strings are refused.
  Scheduler plain(exec, {});
  EXPECT_THROW(plain.submit(p), ApiError);
}

TEST(ServerScheduler, CancelFreesPagesWaitingOrRunning) {
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 1, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 64});
  auto a = s.submit(request(iota_prompt(4), 50));
  auto b = s.submit(request(iota_prompt(4), 50));
  s.step();
  s.step();
  EXPECT_EQ(s.gauges().kv_pages_used, 14);
  a->cancel();
  b->cancel();
  s.step();
  EXPECT_EQ(a->finish_reason(), FinishReason::kCancelled);
  EXPECT_EQ(b->finish_reason(), FinishReason::kCancelled);
  EXPECT_EQ(s.gauges().kv_pages_used, 0);
  EXPECT_TRUE(s.idle());
  EXPECT_TRUE(exec.live.empty());
  EXPECT_EQ(b->wait_finished().size(), 0u);
}

TEST(ServerScheduler, ShutdownRefusesNewRequestsAndCancelAllAnswersEveryone) {
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 1, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 64});
  auto a = s.submit(request(iota_prompt(4), 50));
  auto b = s.submit(request(iota_prompt(4), 50));
  s.step();
  s.stop_accepting();
  try {
    s.submit(request(iota_prompt(4), 2));
    FAIL() << "accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 503);
  }
  s.cancel_all();
  s.step();
  EXPECT_EQ(a->finish_reason(), FinishReason::kCancelled);
  EXPECT_EQ(b->finish_reason(), FinishReason::kCancelled);
  EXPECT_TRUE(s.idle());
}

TEST(ServerScheduler, AFailedStepEndsItsRequestsAndTheNextOnesRun) {
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 64});
  auto a = s.submit(request(iota_prompt(4), 5));
  exec.fail_next_step = true;
  s.step();
  EXPECT_EQ(a->finish_reason(), FinishReason::kError);
  EXPECT_EQ(s.gauges().kv_pages_used, 0);
  EXPECT_TRUE(exec.live.empty());
  auto b = s.submit(request(iota_prompt(4), 5));
  run_until_idle(s);
  EXPECT_EQ(b->wait_finished(), FakeExecutor::expected(iota_prompt(4), 5, 50));
}

TEST(ServerScheduler, AnExecutorFailureEndsEveryRequestAndStopsTheLoop) {
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 2, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 64});
  auto a = s.submit(request(iota_prompt(4), 5));
  auto b = s.submit(request(iota_prompt(3), 5));
  auto waiting = s.submit(request(iota_prompt(2), 5));  // over the running limit
  exec.failed_for_good = true;
  std::thread loop([&] { EXPECT_THROW(s.run(), ExecutorFailure); });  // returns instead of spinning
  loop.join();
  for (const auto& h : {a, b, waiting}) EXPECT_EQ(h->finish_reason(), FinishReason::kError);
  EXPECT_TRUE(s.idle());
  EXPECT_EQ(s.gauges().kv_pages_used, 0);
  EXPECT_TRUE(exec.live.empty());
  try {
    s.submit(request(iota_prompt(4), 5));
    ADD_FAILURE() << "a request was accepted after the executor failed";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 503);
  }
}

}  // namespace
}  // namespace fulcrum::server
