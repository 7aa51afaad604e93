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
  EXPECT_EQ(p.params.prompt, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(p.params.max_tokens, 3);
  EXPECT_FLOAT_EQ(p.params.sampling.temperature, 0.5f);
  EXPECT_EQ(p.params.sampling.top_k, 0);
  EXPECT_EQ(p.params.seed, 42u);
  EXPECT_EQ(p.params.stop_token_ids, (std::vector<int32_t>{7, 0}));  // eos added
  EXPECT_TRUE(p.stream && p.include_usage);
  EXPECT_EQ(parse_completion_request(json{{"prompt", {4}}, {"ignore_eos", true}}, ctx).params.stop_token_ids.size(), 0u);
  EXPECT_EQ(parse_completion_request(json{{"prompt", {4}}}, ctx).params.max_tokens, ctx.default_max_tokens);

  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"echo", true}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"max_tokens", 2.5}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", {4, -1}}}, parse_completion_request, ctx), 400);
  EXPECT_EQ(status_of(json{{"prompt", "text"}}, parse_completion_request, ctx), 400);  // no tokenizer
  EXPECT_EQ(status_of(json{{"prompt", {4}}, {"n", 2}}, parse_completion_request, ctx), 400);
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

TEST(ServerProtocol, ChatUsesTheQwen3Format) {
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_file(test::golden_tokenizer_file());
  ProtocolContext ctx;
  ctx.tokenizer = &tok;
  const ParsedRequest p = parse_chat_request(json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}}, ctx);
  EXPECT_EQ(tok.decode(p.params.prompt), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
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
