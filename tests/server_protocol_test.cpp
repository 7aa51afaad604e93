// Request parsing (strict fields and types) and incremental text with stop strings.
#include <gtest/gtest.h>

#include "server/api_error.hpp"
#include "server/protocol.hpp"
#include "server/text_stream.hpp"
#include "server_test_util.hpp"

namespace fulcrum::server {
namespace {

using nlohmann::json;

int status_of(const json& body, ParsedRequest (*parse)(const json&, const ProtocolContext&), const ProtocolContext& ctx) {
  try {
    parse(body, ctx);
    return 200;
  } catch (const ApiError& e) {
    return e.status();
  }
}

TEST(ServerProtocol, CompletionFieldsAreParsedStrictly) {
  ProtocolContext ctx;
  ctx.model_name = "m";
  ctx.eos_token_ids = {0};
  const ParsedRequest p = parse_completion_request(
      json{{"model", "m"}, {"prompt", {4, 5}}, {"max_tokens", 3}, {"temperature", 0.5}, {"top_p", 0.9}, {"top_k", -1},
           {"seed", 42}, {"stop_token_ids", {7}}, {"stream", true}, {"stream_options", {{"include_usage", true}}}},
      ctx);
  EXPECT_EQ(p.requests.at(0).prompt, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(p.requests.at(0).max_tokens, 3);
  EXPECT_FLOAT_EQ(p.requests.at(0).sampling.temperature, 0.5f);
  EXPECT_EQ(p.requests.at(0).sampling.top_k, 0);
  EXPECT_EQ(p.requests.at(0).seed, 42u);
  EXPECT_EQ(p.requests.at(0).stop_token_ids, (std::vector<int32_t>{7, 0}));  // eos added
  EXPECT_TRUE(p.stream && p.include_usage);
  EXPECT_EQ(parse_completion_request(json{{"prompt", {4}}, {"ignore_eos", true}}, ctx).requests.at(0).stop_token_ids.size(), 0u);
  EXPECT_EQ(parse_completion_request(json{{"prompt", {4}}}, ctx).requests.at(0).max_tokens, ctx.default_max_tokens);

  // Logprobs: the top count in [0, 5]; echo asks for the prompt's from position 1; max_tokens 0 only with echo.
  const ParsedRequest scored = parse_completion_request(
      json{{"prompt", {4, 5, 6}}, {"echo", true}, {"logprobs", 2}, {"max_tokens", 0}}, ctx);
  EXPECT_TRUE(scored.format.logprobs && scored.format.echo && scored.prefill_only);
  EXPECT_TRUE(scored.requests.at(0).logprobs);
  EXPECT_EQ(scored.requests.at(0).top_logprobs, 2);
  EXPECT_EQ(scored.requests.at(0).prompt_logprobs_from, 1);
  EXPECT_EQ(scored.requests.at(0).max_tokens, 1);  // the token a prefill ends in, dropped
  const ParsedRequest echo_only = parse_completion_request(json{{"prompt", {4}}, {"echo", true}}, ctx);
  EXPECT_TRUE(echo_only.format.echo && !echo_only.format.logprobs);
  EXPECT_EQ(echo_only.requests.at(0).prompt_logprobs_from, -1);  // no logprobs: no prompt rows
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"logprobs", 6}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"logprobs", true}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"max_tokens", 0}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"echo", false}, {"logprobs", nullptr}}, parse_completion_request, ctx), 200);
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"max_tokens", 2.5}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", {4, -1}}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", "text"}}, parse_completion_request, ctx), 400);  // no tokenizer
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"n", 0}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"n", 2}, {"stream", true}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", json::array()}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", {{4}, 5}}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"stop", {1}}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"stream_options", {{"x", 1}}}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"model", "other"}}, parse_completion_request, ctx), 404);
  EXPECT_EQ(status_of(json{{"input_ids", {1}}, {"text", "a"}}, parse_generate_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}}, parse_chat_request, ctx), 400);
  EXPECT_THROW(parse_json_body("{\"a\": "), ApiError);
  EXPECT_THROW(parse_json_body("3"), ApiError);
  // Nested 100k deep: refused before parsing (the parser recurses per level), with one short line.
  try {
    parse_json_body("{\"prompt\": " + std::string(100000, '['));
    ADD_FAILURE() << "a 100k-deep body was accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_STREQ(e.what(), "the request body nests JSON deeper than 256 levels");
  }
  const std::string at_limit = std::string(255, '[') + std::string(255, ']');
  EXPECT_TRUE(parse_json_body("{\"a\": " + at_limit + "}").is_object());
}

// A list of prompts and n > 1: one request per (prompt, choice), prompt-major; choice j draws with seed + j.
TEST(ServerProtocol, PromptListsAndNExpandIntoOneRequestPerChoice) {
  ProtocolContext ctx;
  ctx.model_name = "m";
  const ParsedRequest p = parse_completion_request(json{{"prompt", {{4, 5}, {6}}}, {"n", 3}, {"seed", 10}}, ctx);
  ASSERT_EQ(p.requests.size(), 6u);
  EXPECT_EQ(p.n, 3);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(p.requests[i].prompt, i < 3 ? (std::vector<int32_t>{4, 5}) : (std::vector<int32_t>{6})) << i;
    EXPECT_EQ(p.requests[i].seed, 10u + i % 3) << i;
  }
  const ParsedRequest unseeded = parse_completion_request(json{{"prompt", {4}}, {"n", 2}}, ctx);
  ASSERT_EQ(unseeded.requests.size(), 2u);
  EXPECT_FALSE(unseeded.requests[0].seed || unseeded.requests[1].seed);  // each from its own request id
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"n", 65}}, parse_completion_request, ctx), 400);
}

// /generate as SGLang's RuntimeEndpoint sends it (the body below was captured from sglang 0.5.23's frontend:
// stop_token_ids and stop_regex are empty lists, regex and json_schema null); unimplemented fields are 400s
// naming the field unless null, empty or neutral; lists of prompts and n give a batch; max_new_tokens 0 is a
// prefill.
TEST(ServerProtocol, GenerateTakesRuntimeEndpointsFields) {
  ProtocolContext ctx;
  ctx.eos_token_ids = {0};
  const json sampling = {{"skip_special_tokens", true}, {"spaces_between_special_tokens", true},
                         {"max_new_tokens", 5}, {"min_new_tokens", 0}, {"n", 1},
                         {"stop", {"Question", "Assistant:", "<|separator|>"}}, {"stop_token_ids", json::array()},
                         {"stop_regex", json::array()}, {"temperature", 0}, {"top_p", 1.0},
                         {"top_k", -1}, {"min_p", 0.0}, {"frequency_penalty", 0.0}, {"presence_penalty", 0.0},
                         {"ignore_eos", false}, {"regex", nullptr}, {"json_schema", nullptr}};
  const ParsedRequest p = parse_generate_request(json{{"input_ids", {3, 4}}, {"sampling_params", sampling},
                                                      {"return_logprob", false}, {"lora_path", nullptr}}, ctx);
  ASSERT_EQ(p.requests.size(), 1u);
  EXPECT_FALSE(p.batched || p.prefill_only);
  EXPECT_EQ(p.requests[0].max_tokens, 5);
  EXPECT_EQ(p.requests[0].stop_token_ids, (std::vector<int32_t>{0}));  // eos, as SGLang stops at it
  const auto message_of = [&](json body) {
    try {
      parse_generate_request(body, ctx);
    } catch (const ApiError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  json with = sampling;
  with["regex"] = "[0-9]+";
  EXPECT_EQ(message_of({{"input_ids", {3}}, {"sampling_params", with}}), "sampling_params 'regex' is not implemented");
  with = sampling;
  with["stop_regex"] = {"[0-9]+$"};
  EXPECT_EQ(message_of({{"input_ids", {3}}, {"sampling_params", with}}), "sampling_params 'stop_regex' is not implemented");
  with["stop_regex"] = "";
  EXPECT_EQ(message_of({{"input_ids", {3}}, {"sampling_params", with}}), "accepted");  // empty asks for nothing
  with = sampling;
  with["json_schema"] = "{}";
  EXPECT_EQ(message_of({{"input_ids", {3}}, {"sampling_params", with}}), "sampling_params 'json_schema' is not implemented");
  with = sampling;
  with["frequency_penalty"] = 0.5;
  EXPECT_EQ(message_of({{"input_ids", {3}}, {"sampling_params", with}}),
            "sampling_params 'frequency_penalty' other than 0 is not implemented");
  EXPECT_EQ(message_of({{"input_ids", {3}}, {"image_data", "x.png"}}), "'image_data' is not implemented");
  EXPECT_EQ(message_of({{"input_ids", {3}}, {"return_logprob", true}, {"top_logprobs_num", 21}}),
            "'top_logprobs_num' must be in [0, 20], got 21");
  EXPECT_EQ(message_of({{"input_ids", {3}}, {"return_logprob", true}, {"logprob_start_len", 1}}),
            "'logprob_start_len' 1 must be below the prompt's 1 tokens");
  const ParsedRequest with_logprobs = parse_generate_request(
      json{{"input_ids", {3, 4, 5}}, {"return_logprob", true}, {"logprob_start_len", 0}, {"top_logprobs_num", 3}}, ctx);
  EXPECT_EQ(with_logprobs.requests.at(0).prompt_logprobs_from, 1);  // entry 0 of input_token_logprobs is null
  EXPECT_EQ(with_logprobs.requests.at(0).top_logprobs, 3);
  const ParsedRequest default_start = parse_generate_request(json{{"input_ids", {3, 4, 5}}, {"return_logprob", true}}, ctx);
  EXPECT_EQ(default_start.requests.at(0).prompt_logprobs_from, 3);  // the last prompt token only: no prompt rows
  EXPECT_EQ(default_start.format.logprob_start_len, -1);
  EXPECT_EQ(message_of({{"input_ids", {3}}, {"bogus", 1}}), "unknown field 'bogus' in a generate request");
  // Client strings are quoted printable and cut: a key holding a line break would split the error (issue 15).
  EXPECT_EQ(message_of({{"input_ids", {3}}, {"a\nb", 1}}), "unknown field 'a\\x0ab' in a generate request");
  EXPECT_EQ(message_of({{"input_ids", {3}}, {std::string(300, 'k'), 1}}),
            "unknown field '" + std::string(64, 'k') + "...' in a generate request");

  const ParsedRequest batch = parse_generate_request(
      json{{"input_ids", {{3}, {4, 5}}}, {"sampling_params", {{"max_new_tokens", 0}, {"sampling_seed", 9}}}}, ctx);
  ASSERT_EQ(batch.requests.size(), 2u);
  EXPECT_TRUE(batch.batched && batch.prefill_only);
  EXPECT_EQ(batch.requests[1].prompt, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(batch.requests[1].seed, 9u);
  const ParsedRequest n2 = parse_generate_request(json{{"input_ids", {3}}, {"sampling_params", {{"n", 2}}}}, ctx);
  EXPECT_TRUE(n2.batched);
  EXPECT_EQ(n2.requests.size(), 2u);
}

TEST(ServerProtocol, ChatUsesTheQwen3Format) {
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_file(test::golden_tokenizer_file());
  ProtocolContext ctx;
  ctx.tokenizer = &tok;
  const ParsedRequest p = parse_chat_request(json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}}, ctx);
  EXPECT_EQ(tok.decode(p.requests.at(0).prompt), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ServerTextStream, HoldsBackStopStringPrefixesAndNeverEmitsAStopString) {
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_file(test::golden_tokenizer_file());
  const std::vector<int32_t> ids = tok.encode("hello world, bye");
  TextStream plain(&tok, {});
  std::string all;
  for (const int32_t id : ids) all += plain.push(std::span<const int32_t>(&id, 1));
  all += plain.finish(std::nullopt);
  EXPECT_EQ(all, "hello world, bye");

  TextStream stopped(&tok, {"ld, b"});
  std::string out;
  for (const int32_t id : ids) {
    out += stopped.push(std::span<const int32_t>(&id, 1));
    EXPECT_EQ(out.find("ld"), std::string::npos) << out;
  }
  out += stopped.finish(std::string("hello wor").size());
  EXPECT_EQ(out, "hello wor");
  TextStream none(nullptr, {});
  EXPECT_EQ(none.push(ids), "");
}

}  // namespace
}  // namespace fulcrum::server
