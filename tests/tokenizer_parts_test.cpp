// The tokenizer's parts: UTF-8 repair, the byte-level alphabet, the split regex and behaviours, added-token
// flags, BPE merge order, and random round trips.
#include <random>

#include <gtest/gtest.h>

#include "tokenizer/pre_tokenizer.hpp"
#include "tokenizer/tokenizer.hpp"
#include "tokenizer_test_util.hpp"

namespace fulcrum::test {
namespace {

using namespace tokenizer;

const std::string kFffd = "\xEF\xBF\xBD";

TEST(TokenizerUtf8, LossyReplacesMaximalIllFormedParts) {
  EXPECT_EQ(utf8_lossy("abc"), "abc");
  EXPECT_EQ(utf8_lossy("a\x80" "b"), "a" + kFffd + "b");
  EXPECT_EQ(utf8_lossy("\xE4\xBD"), kFffd);                    // truncated 3-byte sequence: one
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x99" "a"), kFffd + "a");      // truncated 4-byte sequence: one
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), kFffd + kFffd + kFffd);  // a surrogate: ED cannot take A0
  EXPECT_EQ(utf8_lossy("\xC0\x80"), kFffd + kFffd);            // overlong NUL
  EXPECT_EQ(utf8_lossy("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);  // above U+10FFFF
  EXPECT_EQ(utf8_lossy("\xE4\xBD\xA0\xE4"), "\xE4\xBD\xA0" + kFffd);
  EXPECT_TRUE(is_valid_utf8("\xF0\x9F\x99\x82"));
  EXPECT_FALSE(is_valid_utf8("\xF0\x9F\x99"));
}

TEST(TokenizerUtf8, NormalForms) {
  EXPECT_EQ(normalize("e\xCC\x81", NormalForm::kNFC), "\xC3\xA9");
  EXPECT_EQ(normalize("\xC3\xA9", NormalForm::kNFD), "e\xCC\x81");
  EXPECT_EQ(normalize("\xEF\xAC\x81", NormalForm::kNFC), "\xEF\xAC\x81");  // the fi ligature stays under NFC
  EXPECT_EQ(normalize("\xEF\xAC\x81", NormalForm::kNFKC), "fi");
  EXPECT_EQ(normalize("\xE1\x84\x80\xE1\x85\xA1", NormalForm::kNFC), "\xEA\xB0\x80");  // Hangul jamo compose
}

TEST(TokenizerByteLevel, AlphabetIsABijection) {
  EXPECT_EQ(bytes_to_byte_level(" "), "\xC4\xA0");   // U+0120 'Ġ'
  EXPECT_EQ(bytes_to_byte_level("\n"), "\xC4\x8A");  // U+010A 'Ċ'
  EXPECT_EQ(bytes_to_byte_level("a~"), "a~");
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  EXPECT_EQ(byte_level_token_bytes(bytes_to_byte_level(all)), all);
  EXPECT_EQ(byte_level_token_bytes("<|im end|>"), "<|im end|>");  // holds a plain space: kept as written
  EXPECT_FALSE(byte_of_char(' ').has_value());
  EXPECT_EQ(byte_of_char(0x143), 0xAD);
}

std::vector<std::string> qwen_split(const std::string& text) {
  const nlohmann::json spec = read_json(golden_qwen_dir() + "/tokenizer.json");
  const Regex pattern(spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"].get<std::string>());
  return split_by(text, pattern, SplitBehavior::kIsolated, false);
}

TEST(TokenizerRegex, QwenPatternPieces) {
  using V = std::vector<std::string>;
  EXPECT_EQ(qwen_split("I'M sure they'll"), (V{"I", "'M", " sure", " they", "'ll"}));
  EXPECT_EQ(qwen_split("a   b"), (V{"a", "  ", " b"}));  // \s+(?!\S) leaves one space for the word
  EXPECT_EQ(qwen_split("x  \n\n y"), (V{"x", "  \n\n", " y"}));
  EXPECT_EQ(qwen_split("2024!!\n"), (V{"2", "0", "2", "4", "!!\n"}));
  EXPECT_EQ(qwen_split("é中文"), (V{"é中文"}));
  // U+0085 is White_Space (a \s) as in HF's engine; U+180E is not, though PCRE2's own \s would take it.
  EXPECT_EQ(qwen_split("a\xC2\x85" "b"), (V{"a", "\xC2\x85" "b"}));
  EXPECT_EQ(qwen_split("a\xE1\xA0\x8E"), (V{"a", "\xE1\xA0\x8E"}));
  EXPECT_EQ(qwen_split("a \xE1\xA0\x8E"), (V{"a", " \xE1\xA0\x8E"}));
}

TEST(TokenizerRegex, WhiteSpaceRewriteKeepsOtherEscapes) {
  EXPECT_EQ(with_white_space_property(R"([^\s\p{L}]\S\\s\d)"), R"([^\p{White_Space}\p{L}]\P{White_Space}\\s\d)");
}

TEST(TokenizerSplit, Behaviours) {
  using V = std::vector<std::string>;
  const Regex dash("-", /*literal=*/true);
  EXPECT_EQ(split_by("a-b--c-", dash, SplitBehavior::kIsolated, false), (V{"a", "-", "b", "-", "-", "c", "-"}));
  EXPECT_EQ(split_by("a-b--c-", dash, SplitBehavior::kRemoved, false), (V{"a", "b", "c"}));
  EXPECT_EQ(split_by("a-b--c-", dash, SplitBehavior::kMergedWithPrevious, false), (V{"a-", "b-", "-", "c-"}));
  EXPECT_EQ(split_by("-a-b--c", dash, SplitBehavior::kMergedWithNext, false), (V{"-a", "-b", "-", "-c"}));
  EXPECT_EQ(split_by("a-b--c-", dash, SplitBehavior::kContiguous, false), (V{"a", "-", "b", "--", "c", "-"}));
  EXPECT_EQ(split_by("a-b--c-", dash, SplitBehavior::kRemoved, /*invert=*/true), (V{"-", "-", "-", "-"}));
  EXPECT_EQ(split_by("", dash, SplitBehavior::kIsolated, false), V{});
}

// The golden tokenizer with its added tokens replaced by `added` (ids from 2000 on).
Tokenizer with_added(const std::vector<nlohmann::json>& added) {
  nlohmann::json spec = read_json(golden_qwen_dir() + "/tokenizer.json");
  int id = 2000;
  for (nlohmann::json a : added) {
    a["id"] = id++;
    for (const char* flag : {"single_word", "lstrip", "rstrip", "normalized", "special"}) {
      if (!a.contains(flag)) a[flag] = false;
    }
    spec["added_tokens"].push_back(a);
  }
  return Tokenizer::from_json(spec, "test");
}

TEST(TokenizerAdded, StripFlagsSwallowWhitespace) {
  const Tokenizer tok = with_added({{{"content", "<L>"}, {"lstrip", true}}, {{"content", "<R>"}, {"rstrip", true}}});
  EXPECT_EQ(tok.encode("a  <L>  b"), (std::vector<int32_t>{tok.encode("a")[0], 2000, tok.encode("  b")[0],
                                                          tok.encode("  b")[1]}));
  EXPECT_EQ(tok.encode("a  <R>  b"), (std::vector<int32_t>{tok.encode("a")[0], tok.encode("  ")[0], 2001, 68}));
  EXPECT_EQ(tok.decode(tok.encode(" <L> ")), "<L> ");
}

TEST(TokenizerAdded, SingleWordNeedsWordBoundaries) {
  const Tokenizer tok = with_added({{{"content", "zq"}, {"single_word", true}}});
  EXPECT_EQ(tok.encode("zq"), std::vector<int32_t>{2000});
  EXPECT_EQ(tok.encode("a zq."), (std::vector<int32_t>{67, 223, 2000, 16}));
  EXPECT_EQ(tok.encode("\xC2\xB2zq"), (std::vector<int32_t>{tok.encode("\xC2\xB2")[0], tok.encode("\xC2\xB2")[1], 2000}));
  for (const char* glued : {"azq", "zq1", "_zq", "zq\xCC\x81"}) {
    const auto ids = tok.encode(glued);
    EXPECT_EQ(std::count(ids.begin(), ids.end(), 2000), 0) << glued;
    EXPECT_EQ(tok.decode(ids), glued);
  }
}

TEST(TokenizerAdded, NormalizedTokensMatchAfterNfc) {
  const std::string composed = "\xC3\xA9", decomposed = "e\xCC\x81";
  const Tokenizer normalized = with_added({{{"content", composed}, {"normalized", true}}});
  EXPECT_EQ(normalized.encode(decomposed), std::vector<int32_t>{2000});
  EXPECT_EQ(normalized.encode(composed), std::vector<int32_t>{2000});
  // A normalized token written decomposed is normalized too, so it matches both spellings.
  const Tokenizer written_decomposed = with_added({{{"content", decomposed}, {"normalized", true}}});
  EXPECT_EQ(written_decomposed.encode(composed), std::vector<int32_t>{2000});
  EXPECT_EQ(written_decomposed.encode(decomposed), std::vector<int32_t>{2000});
  // A raw-text token is matched before NFC, as written.
  const Tokenizer raw = with_added({{{"content", decomposed}, {"normalized", false}}});
  EXPECT_EQ(raw.encode(decomposed), std::vector<int32_t>{2000});
  EXPECT_NE(raw.encode(composed), std::vector<int32_t>{2000});
  EXPECT_EQ(raw.decode(raw.encode("a" + decomposed)), "a" + decomposed);
}

TEST(TokenizerAdded, LongestMatchWins) {
  const Tokenizer tok = with_added({{{"content", "<a>"}}, {{"content", "<a><b>"}}});
  EXPECT_EQ(tok.encode("<a><b><a>"), (std::vector<int32_t>{2001, 2000}));
}

TEST(TokenizerBpe, MergesByRankThenLeftmost) {
  // "a a" outranks "b a"; merges also accept the [left, right] array form.
  nlohmann::json spec = tiny_byte_level_spec({{"a", "a"}, {"b", "a"}});
  const Tokenizer strings = Tokenizer::from_json(spec, "tiny");
  const auto id = [&](const std::string& t) { return *strings.token_to_id(t); };
  EXPECT_EQ(strings.encode("aaaa"), (std::vector<int32_t>{id("aa"), id("aa")}));
  EXPECT_EQ(strings.encode("baaa"), (std::vector<int32_t>{id("b"), id("aa"), id("a")}));
  EXPECT_EQ(strings.encode("aaa"), (std::vector<int32_t>{id("aa"), id("a")}));
  for (auto& m : spec["model"]["merges"]) {
    const std::string text = m.get<std::string>();
    m = nlohmann::json::array({text.substr(0, text.find(' ')), text.substr(text.find(' ') + 1)});
  }
  const Tokenizer pairs = Tokenizer::from_json(spec, "tiny");
  EXPECT_EQ(pairs.encode("baaa aaaa"), strings.encode("baaa aaaa"));
}

// Random code points from the scripts and whitespace that stress the split and NFC, plus any plane.
std::string random_unicode(std::mt19937& rng) {
  static const std::vector<std::pair<char32_t, char32_t>> ranges = {
      {0x20, 0x7E}, {0x09, 0x0D}, {0x80, 0x24F}, {0x300, 0x36F}, {0x5D0, 0x5EA}, {0x1100, 0x11FF},
      {0x3000, 0x3003}, {0x4E00, 0x4E40}, {0xAC00, 0xAC40}, {0x1F600, 0x1F64F}, {0x2000, 0x202F}, {0x180E, 0x180E},
      {0x0, 0x10FFFF}};
  std::string s;
  const int length = std::uniform_int_distribution<int>(0, 40)(rng);
  for (int i = 0; i < length; ++i) {
    const auto& [lo, hi] = ranges[std::uniform_int_distribution<size_t>(0, ranges.size() - 1)(rng)];
    char32_t cp = std::uniform_int_distribution<char32_t>(lo, hi)(rng);
    if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';  // surrogates are not scalar values
    append_utf8(s, cp);
  }
  return s;
}

TEST(TokenizerFuzz, RandomUnicodeRoundTripsAfterNfc) {
  const Tokenizer tok = Tokenizer::from_file(golden_qwen_dir());
  std::mt19937 rng(1234);
  for (int i = 0; i < 3000; ++i) {
    const std::string s = random_unicode(rng);
    ASSERT_EQ(tok.decode(tok.encode(s)), normalize(s, NormalForm::kNFC)) << "case " << i;
  }
}

TEST(TokenizerFuzz, RandomBytesRoundTripOrAreRefused) {
  const Tokenizer tok = Tokenizer::from_file(golden_qwen_dir());
  std::mt19937 rng(99);
  int valid = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string s(std::uniform_int_distribution<int>(0, 12)(rng), '\0');
    for (char& c : s) c = static_cast<char>(std::uniform_int_distribution<int>(0, 255)(rng) >> (i % 2));  // half ASCII
    if (is_valid_utf8(s)) {
      ++valid;
      ASSERT_EQ(tok.decode(tok.encode(s)), normalize(s, NormalForm::kNFC)) << "case " << i;
    } else {
      ASSERT_EQ(error_of([&] { tok.encode(s); }), "cannot encode: the text is not valid UTF-8");
    }
  }
  EXPECT_GT(valid, 1000);
}

TEST(TokenizerFuzz, RandomIdsDecodeToValidUtf8) {
  const Tokenizer tok = Tokenizer::from_file(golden_qwen_dir());
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::vector<int32_t> ids(std::uniform_int_distribution<int>(0, 10)(rng));
    for (int32_t& id : ids) id = std::uniform_int_distribution<int32_t>(0, tok.id_bound() - 1)(rng);
    ASSERT_TRUE(is_valid_utf8(tok.decode(ids)));
  }
}

TEST(TokenizerFuzz, LongRunsStayLinear) {
  const Tokenizer tok = Tokenizer::from_file(golden_qwen_dir());
  for (const std::string& s : {std::string(200000, ' ') + "a", std::string(200000, 'a'), std::string(100000, '\n') + "x"}) {
    EXPECT_EQ(tok.decode(tok.encode(s)), s);
  }
}

}  // namespace
}  // namespace fulcrum::test
