// SGLang's native API as its RuntimeEndpoint uses it (the requests replayed here without the Python client),
// the OpenAI fields that fan out into several choices (a list of prompts, n), and --api-key; a real
// `fulcrum serve` on the tiny model with the golden tokenizer.
#include <gtest/gtest.h>

#include "server_http_util.hpp"
#include "server_process.hpp"
#include "server_test_util.hpp"

namespace fulcrum::test {
namespace {

using nlohmann::json;

std::pair<int, json> get(int port, const std::string& path, const std::string& bearer = "") {
  httplib::Client client("127.0.0.1", port);
  httplib::Headers headers;
  if (!bearer.empty()) headers.emplace("Authorization", "Bearer " + bearer);
  const httplib::Result res = client.Get(path.c_str(), headers);
  if (!res) return {0, json()};
  return {res->status, json::parse(res->body, nullptr, false)};
}

std::vector<int32_t> ids_of(const json& v) { return v.get<std::vector<int32_t>>(); }

class ServerNativeApi : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::signal(SIGPIPE, SIG_IGN);
    dir_ = new TempDir("serve_native_api");
    server_ = new ServerProcess(tiny_served_model(), {"--kv-pages", "64", "--page-size", "8"}, dir_->file("serve.log"));
    tok_ = new tokenizer::Tokenizer(tokenizer::Tokenizer::from_file(golden_tokenizer_file()));
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->terminate(), 0) << server_->log();
    delete server_;
    delete dir_;
    delete tok_;
  }
  static int port() { return server_->port(); }
  static TempDir* dir_;
  static ServerProcess* server_;
  static tokenizer::Tokenizer* tok_;
};
TempDir* ServerNativeApi::dir_ = nullptr;
ServerProcess* ServerNativeApi::server_ = nullptr;
tokenizer::Tokenizer* ServerNativeApi::tok_ = nullptr;

// What RuntimeEndpoint's generate() puts in sampling_params: every field of SglSamplingParams.to_srt_kwargs() and
// the two special-token switches, as captured from sglang 0.5.23's frontend (stop_token_ids and stop_regex empty
// lists, regex and json_schema null; bench/peer/sglang_frontend_check.py runs the real frontend).
json runtime_endpoint_sampling(int max_new_tokens) {
  return {{"skip_special_tokens", true}, {"spaces_between_special_tokens", true}, {"max_new_tokens", max_new_tokens},
          {"min_new_tokens", 0}, {"n", 1}, {"stop", json::array()}, {"stop_token_ids", json::array()},
          {"stop_regex", json::array()}, {"temperature", 0.0}, {"top_p", 1.0}, {"top_k", -1}, {"min_p", 0.0},
          {"frequency_penalty", 0.0}, {"presence_penalty", 0.0}, {"ignore_eos", true}, {"regex", nullptr},
          {"json_schema", nullptr}};
}

TEST_F(ServerNativeApi, RuntimeEndpointConnectsAndGenerates) {
  const auto [info_status, info] = get(port(), "/get_model_info");
  ASSERT_EQ(info_status, 200) << info.dump();
  EXPECT_EQ(info["model_path"], tiny_served_model());
  EXPECT_EQ(info["is_generation"], true);
  const auto [server_status, server_info] = get(port(), "/get_server_info");
  ASSERT_EQ(server_status, 200);
  EXPECT_EQ(server_info["tp_size"], 1);
  EXPECT_EQ(server_info["model_path"], tiny_served_model());
  EXPECT_EQ(get(port(), "/server_info").second, server_info);

  // A few-shot gsm8k-style program: the prefix cached first (max_new_tokens 0), then generated.
  const std::string prompt = "Question: 2 + 3?\nAnswer: 5\n\nQuestion: 4 + 4?\nAnswer:";
  const std::vector<int32_t> prompt_ids = tok_->encode(prompt);
  const auto [prefix_status, prefix] =
      post(port(), "/generate", json{{"text", prompt}, {"sampling_params", {{"max_new_tokens", 0}}}}.dump());
  ASSERT_EQ(prefix_status, 200) << prefix.dump();
  EXPECT_EQ(prefix["output_ids"], json::array());
  EXPECT_EQ(prefix["text"], "");
  EXPECT_EQ(prefix["meta_info"]["prompt_tokens"], prompt_ids.size());
  EXPECT_EQ(prefix["meta_info"]["completion_tokens"], 0);
  EXPECT_EQ(prefix["meta_info"]["finish_reason"]["type"], "length");

  const auto [status, out] = post(port(), "/generate", json{{"text", prompt}, {"sampling_params", runtime_endpoint_sampling(6)}}.dump());
  ASSERT_EQ(status, 200) << out.dump();
  const std::vector<int32_t> expected = generate_greedy(tiny_served_model(), "", {prompt_ids}, 6)[0];
  EXPECT_EQ(ids_of(out["output_ids"]), expected);
  EXPECT_EQ(out["text"], tok_->decode(expected));
  EXPECT_EQ(out["meta_info"]["prompt_tokens"], prompt_ids.size());
  EXPECT_EQ(out["meta_info"]["completion_tokens"], 6);
  EXPECT_EQ(out["meta_info"]["finish_reason"]["type"], "length");

  // select()'s shape: a list of texts gives a list of objects, in order.
  const std::vector<std::string> texts = {prompt + " 8", prompt + " 9"};
  const auto [batch_status, batch] =
      post(port(), "/generate", json{{"text", texts}, {"sampling_params", runtime_endpoint_sampling(3)}}.dump());
  ASSERT_EQ(batch_status, 200) << batch.dump();
  ASSERT_TRUE(batch.is_array() && batch.size() == 2) << batch.dump();
  const auto batch_expected = generate_greedy(tiny_served_model(), "", {tok_->encode(texts[0]), tok_->encode(texts[1])}, 3);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(ids_of(batch[i]["output_ids"]), batch_expected[i]) << i;
}

TEST_F(ServerNativeApi, UnimplementedGenerateFieldsAre400sNamingThem) {
  for (const auto& [field, value, needle] : std::vector<std::tuple<std::string, json, std::string>>{
           {"regex", "[0-9]+", "sampling_params 'regex' is not implemented"},
           {"json_schema", "{\"type\": \"object\"}", "sampling_params 'json_schema' is not implemented"},
           {"presence_penalty", 0.5, "sampling_params 'presence_penalty' other than 0 is not implemented"}}) {
    json sampling = runtime_endpoint_sampling(2);
    sampling[field] = value;
    const auto [status, out] = post(port(), "/generate", json{{"input_ids", {1, 2}}, {"sampling_params", sampling}}.dump());
    EXPECT_EQ(status, 400) << field;
    EXPECT_EQ(out["error"]["message"], needle) << out.dump();
    EXPECT_EQ(out["error"]["type"], "invalid_request_error");
  }
  const auto [status, out] = post(port(), "/generate", json{{"input_ids", {1}}, {"return_hidden_states", true}}.dump());
  EXPECT_EQ(status, 400);
  EXPECT_EQ(out["error"]["message"], "'return_hidden_states' true is not implemented") << out.dump();
}

// A list of prompts (strings and token-id lists) gives one choice each, `index` set, usage summed; n = 2 gives
// choices that draw with seed and seed + 1, each equal to a one-choice request with that seed.
TEST_F(ServerNativeApi, PromptListsAndNGiveOneChoiceEach) {
  const std::vector<int32_t> ids = {5, 17, 300, 42};
  const json prompts = json::array({"The quick brown fox", ids});
  const auto [status, out] =
      post(port(), "/v1/completions", json{{"prompt", prompts}, {"max_tokens", 4}, {"ignore_eos", true}}.dump());
  ASSERT_EQ(status, 200) << out.dump();
  ASSERT_EQ(out["choices"].size(), 2u);
  const std::vector<int32_t> fox = tok_->encode("The quick brown fox");
  const auto expected = generate_greedy(tiny_served_model(), "", {fox, ids}, 4);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(out["choices"][i]["index"], i);
    EXPECT_EQ(ids_of(out["choices"][i]["token_ids"]), expected[i]) << i;
  }
  EXPECT_EQ(out["usage"]["prompt_tokens"], fox.size() + ids.size());
  EXPECT_EQ(out["usage"]["completion_tokens"], 8);
  EXPECT_EQ(out["usage"]["total_tokens"], fox.size() + ids.size() + 8);

  const json sampled = {{"prompt", ids}, {"max_tokens", 6}, {"ignore_eos", true}, {"temperature", 1.0}, {"seed", 5}};
  json two = sampled;
  two["n"] = 2;
  const auto [n_status, n_out] = post(port(), "/v1/completions", two.dump());
  ASSERT_EQ(n_status, 200) << n_out.dump();
  ASSERT_EQ(n_out["choices"].size(), 2u);
  EXPECT_EQ(n_out["usage"]["prompt_tokens"], ids.size());  // one prompt, counted once
  EXPECT_EQ(n_out["usage"]["completion_tokens"], 12);
  for (int j = 0; j < 2; ++j) {
    json one = sampled;
    one["seed"] = 5 + j;
    const auto [s, single] = post(port(), "/v1/completions", one.dump());
    ASSERT_EQ(s, 200);
    EXPECT_EQ(n_out["choices"][j]["index"], j);
    EXPECT_EQ(n_out["choices"][j]["token_ids"], single["choices"][0]["token_ids"]) << j;
  }
  two["stream"] = true;
  const auto [stream_status, stream_out] = post(port(), "/v1/completions", two.dump());
  EXPECT_EQ(stream_status, 400);
  EXPECT_EQ(stream_out["error"]["message"], "streaming more than one choice (n > 1 or a list of prompts) is not implemented");
}

// --api-key: Bearer on every route but /health and /metrics; 401 in OpenAI's error shape otherwise.
TEST(ServerApiKey, RoutesNeedTheBearerKeyButHealthAndMetrics) {
  TempDir dir("serve_api_key");
  ServerProcess server(tiny_served_model(), {"--api-key", "sesame"}, dir.file("serve.log"));
  for (const std::string bearer : {"", "wrong"}) {
    const auto [status, out] = get(server.port(), "/v1/models", bearer);
    EXPECT_EQ(status, 401) << bearer;
    EXPECT_EQ(out["error"]["type"], "authentication_error") << out.dump();
    EXPECT_TRUE(out["error"]["message"].is_string());
  }
  EXPECT_EQ(post(server.port(), "/v1/completions", R"({"prompt": [1, 2], "max_tokens": 1})").first, 401);
  EXPECT_EQ(get(server.port(), "/v1/models", "sesame").first, 200);
  EXPECT_EQ(get(server.port(), "/get_model_info", "sesame").first, 200);
  EXPECT_EQ(get(server.port(), "/health").first, 200);
  httplib::Client client("127.0.0.1", server.port());
  const httplib::Result m = client.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  const httplib::Result r = client.Post("/v1/completions", httplib::Headers{{"Authorization", "Bearer sesame"}},
                                        R"({"prompt": [1, 2], "max_tokens": 1})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

}  // namespace
}  // namespace fulcrum::test
