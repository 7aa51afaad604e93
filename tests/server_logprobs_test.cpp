// Logprobs end to end on the tiny model: the step interface's sampled, top and prompt logprobs equal a
// log-softmax the test computes from the standalone CPU model's logits for the same prompt; then a real
// `fulcrum serve`: OpenAI completions logprobs, lm-eval's scoring request (echo + logprobs + max_tokens 0 / 1),
// chat logprobs / top_logprobs, streaming, SGLang's /generate return_logprob, and the 400s.
#include <cmath>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "model/generate.hpp"
#include "model/step_model.hpp"
#include "server/engine_step_executor.hpp"
#include "server_http_util.hpp"
#include "server_process.hpp"
#include "server_test_util.hpp"

namespace fulcrum::test {
namespace {

using nlohmann::json;
constexpr double kTolerance = 1e-4;  // the served engine's logits against the standalone model's

// The test's own log-softmax of one row, in double.
std::vector<double> log_softmax(std::span<const float> row) {
  double max = -INFINITY;
  for (const float x : row) max = std::max(max, static_cast<double>(x));
  double sum = 0.0;
  for (const float x : row) sum += std::exp(x - max);
  std::vector<double> out;
  for (const float x : row) out.push_back(x - max - std::log(sum));
  return out;
}

// Standalone prompt logits [prompt_len, vocab] of the tiny model, as log-softmax rows.
std::vector<std::vector<double>> prompt_log_softmax(const std::vector<int32_t>& prompt) {
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(tiny_served_model());
  backend::CpuBackend backend;
  model::Qwen3MoeModel solo(config, backend);
  model::Checkpoint checkpoint(tiny_served_model());
  solo.load_weights(checkpoint);
  const model::HostTensor logits = model::generate_greedy(solo, backend, {prompt}, 1).prompt_logits[0];
  const auto vocab = static_cast<size_t>(config.vocab_size);
  std::vector<std::vector<double>> rows;
  for (size_t r = 0; r < prompt.size(); ++r) rows.push_back(log_softmax(std::span<const float>(logits.data).subspan(r * vocab, vocab)));
  return rows;
}

std::vector<int32_t> test_prompt(int length, int vocab, uint64_t seed) {
  model::Rng rng(seed);
  std::vector<int32_t> p;
  for (int i = 0; i < length; ++i) p.push_back(static_cast<int32_t>(rng.next() % static_cast<uint64_t>(vocab)));
  return p;
}

// Ids of the `n` largest values, descending, lower id on ties (the test's own order).
std::vector<int32_t> top_ids(const std::vector<double>& row, int n) {
  std::vector<int32_t> ids(row.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
  ids.resize(static_cast<size_t>(n));
  return ids;
}

// A 13-token prompt in two chunks (8 tokens, not sampling; 5 tokens, sampling greedily): every prompt target
// and the sampled token get the test's log-softmax of the row before them, with the top 5 sorted and headed by
// the greedy token.
TEST(StepLogprobs, PromptAndSampledLogprobsEqualTheModelsLogSoftmax) {
  server::EngineExecutorOptions options;
  options.model_dir = tiny_served_model();
  server::EngineStepExecutor executor(options);
  const std::vector<int32_t> prompt = test_prompt(13, executor.vocab_size(), 5);
  const std::vector<std::vector<double>> want = prompt_log_softmax(prompt);
  executor.allocate(1, 16);
  model::StepSequence first;
  first.id = 1;
  first.token_ids = std::span<const int32_t>(prompt).first(8);
  first.prompt_targets = std::span<const int32_t>(prompt).subspan(1, 8);  // rows 0..7 predict positions 1..8
  first.top_logprobs = 5;
  model::StepOutput out = executor.step(std::span(&first, 1));
  ASSERT_TRUE(out.errors[0].empty()) << out.errors[0];
  ASSERT_EQ(out.prompt_logprobs[0].size(), 8u);
  EXPECT_EQ(out.tokens[0], -1);
  model::StepSequence second;
  second.id = 1;
  second.token_ids = std::span<const int32_t>(prompt).subspan(8);
  second.prompt_targets = std::span<const int32_t>(prompt).subspan(9);  // rows 0..3 predict 9..12; row 4 samples
  second.sample = true;
  second.want_logprob = true;
  second.top_logprobs = 5;
  const model::StepOutput last = executor.step(std::span(&second, 1));
  ASSERT_TRUE(last.errors[0].empty()) << last.errors[0];
  ASSERT_EQ(last.prompt_logprobs[0].size(), 4u);
  std::vector<model::TokenLogprob> all = out.prompt_logprobs[0];
  all.insert(all.end(), last.prompt_logprobs[0].begin(), last.prompt_logprobs[0].end());
  for (size_t pos = 1; pos < prompt.size(); ++pos) {
    const model::TokenLogprob& lp = all[pos - 1];
    const std::vector<double>& row = want[pos - 1];
    EXPECT_NEAR(lp.logprob, row[static_cast<size_t>(prompt[pos])], kTolerance) << "position " << pos;
    ASSERT_EQ(lp.top_ids.size(), 5u);
    EXPECT_EQ(lp.top_ids, top_ids(row, 5)) << "position " << pos;
    for (size_t k = 0; k < 5; ++k) {
      EXPECT_NEAR(lp.top_logprobs[k], row[static_cast<size_t>(lp.top_ids[k])], kTolerance);
      if (k > 0) {
        EXPECT_GE(lp.top_logprobs[k - 1], lp.top_logprobs[k]);
      }
      if (lp.top_ids[k] == prompt[pos]) {
        EXPECT_EQ(lp.top_logprobs[k], lp.logprob) << "one normalizer per row";
      }
    }
  }
  // Greedy: the sampled token heads its own top, with the same value.
  const std::vector<double>& row = want.back();
  EXPECT_EQ(last.tokens[0], top_ids(row, 1)[0]);
  EXPECT_NEAR(last.logprobs[0], row[static_cast<size_t>(last.tokens[0])], kTolerance);
  ASSERT_EQ(last.top_logprobs[0].top_ids.size(), 5u);
  EXPECT_EQ(last.top_logprobs[0].top_ids[0], last.tokens[0]);
  EXPECT_EQ(last.top_logprobs[0].top_logprobs[0], last.logprobs[0]);
  executor.release(1);
}

class ServerLogprobs : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::signal(SIGPIPE, SIG_IGN);
    dir_ = new TempDir("serve_logprobs");
    // Prefill chunks of 8 tokens: a prompt's logprobs gather over several steps.
    server_ = new ServerProcess(tiny_served_model(), {"--kv-pages", "64", "--page-size", "8", "--max-prefill-tokens", "8"},
                                dir_->file("serve.log"));
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->terminate(), 0) << server_->log();
    delete server_;
    delete dir_;
  }
  static int port() { return server_->port(); }
  static TempDir* dir_;
  static ServerProcess* server_;
};
TempDir* ServerLogprobs::dir_ = nullptr;
ServerProcess* ServerLogprobs::server_ = nullptr;

bool has_logprobs(const json& event) {
  return !event["choices"].empty() && event["choices"][0].contains("logprobs") && !event["choices"][0]["logprobs"].is_null();
}

int vocab() { return model::load_qwen3_moe_config(tiny_served_model()).vocab_size; }

// lm-eval's local-completions loglikelihood request: token-id prompt (context + continuation), echo, logprobs 1,
// max_tokens 1 (and 0). Its score, the sum of the continuation's token_logprobs, equals the test's sum.
TEST_F(ServerLogprobs, EchoScoresAContinuationAsTheModelDoes) {
  const std::vector<int32_t> prompt = test_prompt(19, vocab(), 9);
  constexpr size_t kContext = 11;
  const std::vector<std::vector<double>> want = prompt_log_softmax(prompt);
  double expected_sum = 0.0;
  for (size_t pos = kContext; pos < prompt.size(); ++pos) expected_sum += want[pos - 1][static_cast<size_t>(prompt[pos])];
  for (const int max_tokens : {1, 0}) {
    const json request = {{"prompt", json::array({prompt})}, {"temperature", 0}, {"max_tokens", max_tokens},
                          {"logprobs", 1}, {"seed", 1234}, {"echo", true}};
    const auto [status, body] = post(port(), "/v1/completions", request.dump());
    ASSERT_EQ(status, 200) << body.dump();
    const json& lp = body["choices"][0]["logprobs"];
    const size_t n = prompt.size() + static_cast<size_t>(max_tokens);
    ASSERT_EQ(lp["token_logprobs"].size(), n) << lp.dump();
    ASSERT_EQ(lp["tokens"].size(), n);
    ASSERT_EQ(lp["top_logprobs"].size(), n);
    ASSERT_EQ(lp["text_offset"].size(), n);
    EXPECT_TRUE(lp["token_logprobs"][0].is_null());
    EXPECT_TRUE(lp["top_logprobs"][0].is_null());
    double sum = 0.0;
    bool greedy = true;
    for (size_t pos = kContext; pos < prompt.size(); ++pos) {
      const double value = lp["token_logprobs"][pos].get<double>();
      EXPECT_NEAR(value, want[pos - 1][static_cast<size_t>(prompt[pos])], kTolerance) << "position " << pos;
      sum += value;
      ASSERT_EQ(lp["top_logprobs"][pos].size(), 1u);
      greedy = greedy && value == lp["top_logprobs"][pos].begin().value().get<double>();
    }
    EXPECT_NEAR(sum, expected_sum, kTolerance * static_cast<double>(prompt.size()));
    bool expected_greedy = true;
    for (size_t pos = kContext; pos < prompt.size(); ++pos) {
      expected_greedy = expected_greedy && top_ids(want[pos - 1], 1)[0] == prompt[pos];
    }
    EXPECT_EQ(greedy, expected_greedy);
    EXPECT_EQ(body["usage"]["completion_tokens"].get<int>(), max_tokens);
    EXPECT_EQ(body["usage"]["prompt_tokens"].get<size_t>(), prompt.size());
  }
}

TEST_F(ServerLogprobs, CompletionLogprobsMatchTheGreedyTokens) {
  const std::vector<int32_t> prompt = test_prompt(6, vocab(), 3);
  const std::vector<std::vector<double>> want = prompt_log_softmax(prompt);
  const json request = {{"prompt", prompt}, {"temperature", 0}, {"max_tokens", 3}, {"logprobs", 5}, {"ignore_eos", true}};
  const auto [status, body] = post(port(), "/v1/completions", request.dump());
  ASSERT_EQ(status, 200) << body.dump();
  const json& choice = body["choices"][0];
  const json& lp = choice["logprobs"];
  ASSERT_EQ(lp["token_logprobs"].size(), 3u);
  const std::vector<int32_t> ids = choice["token_ids"].get<std::vector<int32_t>>();
  EXPECT_EQ(ids[0], top_ids(want.back(), 1)[0]);
  EXPECT_NEAR(lp["token_logprobs"][0].get<double>(), want.back()[static_cast<size_t>(ids[0])], kTolerance);
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_EQ(lp["top_logprobs"][i].size(), 5u) << lp.dump();  // distinct token texts in the golden tokenizer
    double best = -INFINITY;
    for (const auto& [text, value] : lp["top_logprobs"][i].items()) best = std::max(best, value.get<double>());
    EXPECT_EQ(lp["token_logprobs"][i].get<double>(), best) << "greedy: the token is its row's best";
  }
  EXPECT_EQ(lp["text_offset"][0].get<int>(), 0);
}

TEST_F(ServerLogprobs, ChatLogprobsAndStreaming) {
  const json chat = {{"messages", json::array({{{"role", "user"}, {"content", "hello there"}}})}, {"temperature", 0},
                     {"max_tokens", 4}, {"logprobs", true}, {"top_logprobs", 3}, {"ignore_eos", true}};
  const auto [status, body] = post(port(), "/v1/chat/completions", chat.dump());
  ASSERT_EQ(status, 200) << body.dump();
  const json& content = body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u);
  for (const json& entry : content) {
    ASSERT_EQ(entry["top_logprobs"].size(), 3u);
    EXPECT_EQ(entry["logprob"], entry["top_logprobs"][0]["logprob"]) << "greedy";
    EXPECT_EQ(entry["token"], entry["top_logprobs"][0]["token"]);
    EXPECT_TRUE(entry["bytes"].is_array());
  }
  json streamed = chat;
  streamed["stream"] = true;
  const Streamed s = stream_post(port(), "/v1/chat/completions", streamed);
  ASSERT_EQ(s.status, 200) << s.body;
  std::vector<json> entries;
  for (const json& e : s.events) {
    if (!has_logprobs(e)) continue;
    for (const json& entry : e["choices"][0]["logprobs"]["content"]) entries.push_back(entry);
  }
  EXPECT_EQ(json(entries), content) << "streamed logprobs equal the whole body's";

  const std::vector<int32_t> prompt = test_prompt(6, vocab(), 3);
  const json completion = {{"prompt", prompt}, {"temperature", 0}, {"max_tokens", 3}, {"logprobs", 2}, {"ignore_eos", true}};
  const auto [cstatus, cbody] = post(port(), "/v1/completions", completion.dump());
  ASSERT_EQ(cstatus, 200);
  json cstream = completion;
  cstream["stream"] = true;
  const Streamed cs = stream_post(port(), "/v1/completions", cstream);
  ASSERT_EQ(cs.status, 200) << cs.body;
  json values = json::array(), offsets = json::array();
  for (const json& e : cs.events) {
    if (!has_logprobs(e)) continue;
    for (const json& v : e["choices"][0]["logprobs"]["token_logprobs"]) values.push_back(v);
    for (const json& v : e["choices"][0]["logprobs"]["text_offset"]) offsets.push_back(v);
  }
  EXPECT_EQ(values, cbody["choices"][0]["logprobs"]["token_logprobs"]);
  EXPECT_EQ(offsets, cbody["choices"][0]["logprobs"]["text_offset"]);
}

// SGLang's meta_info: input_token_logprobs over prompt[logprob_start_len..] (entry 0 null), output ones, tops.
TEST_F(ServerLogprobs, GenerateReturnsSglangLogprobs) {
  const std::vector<int32_t> prompt = test_prompt(12, vocab(), 4);
  const std::vector<std::vector<double>> want = prompt_log_softmax(prompt);
  const json request = {{"input_ids", prompt}, {"return_logprob", true}, {"logprob_start_len", 3}, {"top_logprobs_num", 2},
                        {"return_text_in_logprobs", true},
                        {"sampling_params", {{"max_new_tokens", 2}, {"temperature", 0}, {"ignore_eos", true}}}};
  const auto [status, body] = post(port(), "/generate", request.dump());
  ASSERT_EQ(status, 200) << body.dump();
  const json& meta = body["meta_info"];
  const json& input = meta["input_token_logprobs"];
  ASSERT_EQ(input.size(), prompt.size() - 3) << meta.dump();
  EXPECT_TRUE(input[0][0].is_null());
  EXPECT_EQ(input[0][1].get<int32_t>(), prompt[3]);
  EXPECT_TRUE(input[0][2].is_string());
  for (size_t j = 1; j < input.size(); ++j) {
    const size_t pos = 3 + j;
    EXPECT_EQ(input[j][1].get<int32_t>(), prompt[pos]);
    EXPECT_NEAR(input[j][0].get<double>(), want[pos - 1][static_cast<size_t>(prompt[pos])], kTolerance) << "position " << pos;
    ASSERT_EQ(meta["input_top_logprobs"][j].size(), 2u);
    EXPECT_EQ(meta["input_top_logprobs"][j][0][1].get<int32_t>(), top_ids(want[pos - 1], 1)[0]);
  }
  EXPECT_TRUE(meta["input_top_logprobs"][0].is_null());
  ASSERT_EQ(meta["output_token_logprobs"].size(), 2u);
  EXPECT_EQ(meta["output_token_logprobs"][0][1], body["output_ids"][0]);
  EXPECT_NEAR(meta["output_token_logprobs"][0][0].get<double>(),
              want.back()[body["output_ids"][0].get<size_t>()], kTolerance);
  ASSERT_EQ(meta["output_top_logprobs"].size(), 2u);
  EXPECT_EQ(meta["output_top_logprobs"][0][0][1], body["output_ids"][0]);
  // Default logprob_start_len (-1): the last prompt token only, null; no text without return_text_in_logprobs.
  const json plain = {{"input_ids", prompt}, {"return_logprob", true}, {"sampling_params", {{"max_new_tokens", 1}}}};
  const auto [pstatus, pbody] = post(port(), "/generate", plain.dump());
  ASSERT_EQ(pstatus, 200) << pbody.dump();
  ASSERT_EQ(pbody["meta_info"]["input_token_logprobs"].size(), 1u);
  EXPECT_EQ(pbody["meta_info"]["input_token_logprobs"][0], json::array({nullptr, prompt.back(), nullptr}));
  EXPECT_FALSE(pbody["meta_info"].contains("input_top_logprobs"));
}

TEST_F(ServerLogprobs, OutOfRangeValuesAreOpenAiErrors) {
  const std::vector<int32_t> prompt = test_prompt(4, vocab(), 2);
  const std::pair<json, std::string> cases[] = {
      {{{"prompt", prompt}, {"logprobs", 6}}, "'logprobs' must be in [0, 5]"},
      {{{"prompt", prompt}, {"logprobs", -1}}, "'logprobs' must be in [0, 5]"},
      {{{"prompt", prompt}, {"max_tokens", 0}}, "'max_tokens' 0 needs 'echo' true"},
      {{{"prompt", prompt}, {"echo", true}, {"logprobs", 1}, {"stream", true}}, "'echo' with 'stream' is not implemented"},
  };
  for (const auto& [request, message] : cases) {
    const auto [status, body] = post(port(), "/v1/completions", request.dump());
    EXPECT_EQ(status, 400) << request.dump();
    EXPECT_NE(body["error"]["message"].get<std::string>().find(message), std::string::npos) << body.dump();
    EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  }
  const json messages = json::array({{{"role", "user"}, {"content", "hi"}}});
  const std::pair<json, std::string> chat_cases[] = {
      {{{"messages", messages}, {"logprobs", true}, {"top_logprobs", 21}}, "'top_logprobs' must be in [0, 20]"},
      {{{"messages", messages}, {"top_logprobs", 2}}, "'top_logprobs' needs 'logprobs' true"},
      {{{"messages", messages}, {"logprobs", 1}}, "'logprobs' must be a boolean"},
  };
  for (const auto& [request, message] : chat_cases) {
    const auto [status, body] = post(port(), "/v1/chat/completions", request.dump());
    EXPECT_EQ(status, 400) << request.dump();
    EXPECT_NE(body["error"]["message"].get<std::string>().find(message), std::string::npos) << body.dump();
  }
  const json generate = {{"input_ids", prompt}, {"return_logprob", true}, {"logprob_start_len", 4}};
  const auto [status, body] = post(port(), "/generate", generate.dump());
  EXPECT_EQ(status, 400);
  EXPECT_NE(body["error"]["message"].get<std::string>().find("'logprob_start_len' 4 must be below"), std::string::npos)
      << body.dump();
}

}  // namespace
}  // namespace fulcrum::test
