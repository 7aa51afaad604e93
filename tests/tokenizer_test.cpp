// The tokenizer end to end: HF's golden encodings, unsupported features refused, Qwen3 chat format,
// encode throughput, and `fulcrum tokenize`.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>

#include <sys/wait.h>

#include <gtest/gtest.h>

#include "model_test_util.hpp"
#include "tokenizer/chat.hpp"
#include "tokenizer/tokenizer.hpp"
#include "tokenizer_test_util.hpp"

namespace fulcrum::test {
namespace {

using tokenizer::Tokenizer;

TEST(Tokenizer, ReproducesGolden) {
  const auto dirs = golden_tokenizer_dirs();
  ASSERT_FALSE(dirs.empty());
  for (const std::string& dir : dirs) {
    const Tokenizer tok = Tokenizer::from_file(dir + "/tokenizer.json");
    const nlohmann::json golden = read_json(dir + "/golden.json");
    ASSERT_FALSE(golden.at("cases").empty());
    for (const auto& c : golden.at("cases")) {
      const std::string text = c.at("text").get<std::string>();
      const auto expected = c.at("ids").get<std::vector<int32_t>>();
      EXPECT_EQ(tok.encode(text), expected) << dir << ": " << text;
      EXPECT_EQ(tok.decode(expected), c.at("decoded").get<std::string>()) << dir << ": " << text;
    }
  }
}

TEST(Tokenizer, LoadsFromFolder) {
  const Tokenizer tok = Tokenizer::from_file(golden_qwen_dir());
  EXPECT_EQ(tok.token_to_id("<|im_end|>"), 2);
  EXPECT_EQ(tok.id_bound(), 2000);
}

TEST(Tokenizer, SkipsSpecialTokensOnRequest) {
  const Tokenizer tok = Tokenizer::from_file(golden_qwen_dir());
  const auto ids = tok.encode("a<|im_end|>b");
  EXPECT_EQ(tok.decode(ids), "a<|im_end|>b");
  EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/true), "ab");
}

std::string load_error(nlohmann::json spec) {
  return error_of([&] { Tokenizer::from_json(spec, "my/tokenizer.json"); });
}

TEST(Tokenizer, RefusesUnsupportedFeatures) {
  const nlohmann::json base = read_json(golden_qwen_dir() + "/tokenizer.json");
  const auto with = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json spec = base;
    spec[key] = value;
    return load_error(spec);
  };
  const auto with_model = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json spec = base;
    spec["model"][key] = value;
    return load_error(spec);
  };
  EXPECT_EQ(load_error(base), "");
  // What Qwen3's own file adds on top of the golden one loads too.
  nlohmann::json qwen3 = base;
  qwen3["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}};
  qwen3["model"]["continuing_subword_prefix"] = "";
  qwen3["model"]["end_of_word_suffix"] = "";
  EXPECT_EQ(load_error(qwen3), "");
  EXPECT_EQ(with("normalizer", {{"type", "Lowercase"}}),
            "my/tokenizer.json: unsupported normalizer 'Lowercase' (supported: NFC, NFD, NFKC, NFKD, Sequence)");
  EXPECT_EQ(with("pre_tokenizer", {{"type", "Whitespace"}}),
            "my/tokenizer.json: unsupported pre_tokenizer 'Whitespace' (supported: Split, ByteLevel, Sequence)");
  EXPECT_EQ(with("decoder", nullptr), "my/tokenizer.json: unsupported decoder 'null' (supported: ByteLevel)");
  EXPECT_EQ(with("post_processor", {{"type", "TemplateProcessing"}}),
            "my/tokenizer.json: unsupported post_processor 'TemplateProcessing'");
  EXPECT_EQ(with("truncation", {{"max_length", 8}}), "my/tokenizer.json: truncation is not supported");
  EXPECT_EQ(with_model("type", "WordPiece"), "my/tokenizer.json: unsupported model type 'WordPiece' (supported: BPE)");
  EXPECT_EQ(with_model("dropout", 0.1), "my/tokenizer.json: BPE dropout is not supported");
  EXPECT_EQ(with_model("byte_fallback", true), "my/tokenizer.json: BPE byte_fallback is not supported");
  EXPECT_EQ(with_model("merges", {"Ġ Ġ", "zz qq"}),
            "my/tokenizer.json: merge 'zz qq' uses a token missing from the vocab");
  // A merge's tokens are quoted escaped: one with a newline stays one line (found by fuzz/fuzz_tokenizer_json).
  EXPECT_EQ(with_model("merges", {"z\nz qq"}),
            "my/tokenizer.json: merge 'z\\x0az qq' uses a token missing from the vocab");
  nlohmann::json bad_split = base;
  bad_split["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
  EXPECT_EQ(load_error(bad_split), "my/tokenizer.json: unsupported Split behavior 'Sideways'");
  nlohmann::json bad_regex = base;
  bad_regex["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  EXPECT_NE(load_error(bad_regex).find("bad regex '(unclosed'"), std::string::npos);
  const std::string malformed = load_error({{"model", {{"vocab", 3}}}, {"decoder", {{"type", "ByteLevel"}}}});
  EXPECT_EQ(malformed.rfind("my/tokenizer.json: malformed tokenizer (", 0), 0u) << malformed;
  EXPECT_EQ(error_of([] { Tokenizer::from_file("/nonexistent/dir"); }),
            "cannot open tokenizer file '/nonexistent/dir'");
}

TEST(Tokenizer, RefusesBadInputAndIds) {
  const Tokenizer tok = Tokenizer::from_file(golden_qwen_dir());
  EXPECT_EQ(error_of([&] { tok.encode("ab\xff"); }), "cannot encode: the text is not valid UTF-8");
  EXPECT_EQ(error_of([&] { tok.decode({5, 2000}); }), "cannot decode: no token has id 2000 (ids are below 2000)");
  EXPECT_EQ(error_of([&] { tok.decode({-1}); }), "cannot decode: no token has id -1 (ids are below 2000)");
}

TEST(TokenizerChat, FormatsQwen3Messages) {
  const std::vector<tokenizer::ChatMessage> messages = {{"system", "Be brief."}, {"user", "hi"}};
  EXPECT_EQ(tokenizer::format_chat(messages),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(tokenizer::format_chat(messages, /*add_generation_prompt=*/false),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n");
}

TEST(TokenizerChat, EncodesMarkersAsSingleTokens) {
  const Tokenizer tok = Tokenizer::from_file(golden_qwen_dir());
  const auto ids = tokenizer::encode_chat(tok, {{"user", "hi"}});
  // "user\nhi" is 87 423 201 74 75 in the golden case "...<|im_start|>user\nhi"; 201 is the newline.
  const std::vector<int32_t> expected = {1, 87, 423, 201, 74, 75, 2, 201, 1, 67, 320, 508, 947, 201};
  EXPECT_EQ(ids, expected);
  EXPECT_EQ(tok.decode(ids), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(tok.decode({67, 320, 508, 947}), "assistant");
}

TEST(TokenizerChat, NeedsTheMarkerTokens) {
  const Tokenizer tok = Tokenizer::from_json(tiny_byte_level_spec({}), "tiny");
  EXPECT_EQ(error_of([&] { tokenizer::encode_chat(tok, {{"user", "hi"}}); }),
            "chat format needs the added token <|im_start|> that this tokenizer lacks");
}

void report_speed(const Tokenizer& tok, const std::string& what, const std::string& text) {
  const auto start = std::chrono::steady_clock::now();
  const auto ids = tok.encode(text);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[ speed    ] %s: %zu bytes -> %zu tokens in %.3f s: %.0f tokens/s, %.1f MB/s\n", what.c_str(),
              text.size(), ids.size(), seconds, ids.size() / seconds, text.size() / seconds / 1e6);
  EXPECT_TRUE(tok.decode(ids) == tokenizer::normalize(text, tokenizer::NormalForm::kNFC)) << what;
}

// Not a pass/fail check: prints encode rates on ~1 MB texts. The golden texts repeated hit the merge cache
// almost always (as real prose mostly does); random words almost never do.
TEST(TokenizerSpeed, EncodesLongText) {
  const Tokenizer tok = Tokenizer::from_file(golden_qwen_dir());
  std::string repeated;
  const nlohmann::json golden = read_json(golden_qwen_dir() + "/golden.json");
  while (repeated.size() < (1 << 20)) {
    for (const auto& c : golden.at("cases")) repeated += c.at("text").get<std::string>() + " ";
  }
  report_speed(tok, "golden texts repeated", repeated);
  std::mt19937 rng(5);
  std::string random_words;
  while (random_words.size() < (1 << 20)) {
    const int length = std::uniform_int_distribution<int>(3, 12)(rng);
    random_words += ' ';
    for (int i = 0; i < length; ++i) random_words += static_cast<char>('a' + rng() % 26);
  }
  report_speed(tok, "random words", random_words);
}

TEST(TokenizerCli, EncodesAndDecodes) {
  TempDir dir("tokenize");
  const std::string model = " --model " + golden_qwen_dir();
  CliRun run = run_cli(dir, "tokenize" + model + " --text 'Hello<|im_end|>world'");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "42 592 324 2 89 269 1513\n");
  run = run_cli(dir, "tokenize" + model + " --decode '42 592 324 2 89 269 1513'");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "Hello<|im_end|>world\n");
}

TEST(TokenizerCli, OneLineErrors) {
  TempDir dir("tokenize");
  const std::string model = " --model " + golden_qwen_dir();
  const auto expect_error = [&](const std::string& args, const std::string& message) {
    const CliRun run = run_cli(dir, args);
    EXPECT_NE(run.exit_code, 0) << args;
    EXPECT_EQ(run.err, "fulcrum: error: " + message + "\n") << args;
  };
  expect_error("tokenize --model " + dir.path() + " --text hi",
               "cannot open tokenizer file '" + dir.file("tokenizer.json") + "'");
  expect_error("tokenize" + model + " --decode '1 x'", "--decode: 'x' is not a token id");
  expect_error("tokenize" + model + " --decode '7 2000'", "--decode: token id 2000 out of range [0, 2000)");
  expect_error("tokenize" + model, "tokenize needs --text or --decode");
}

}  // namespace
}  // namespace fulcrum::test
