// What the fuzz harnesses (fuzz/, scripts/fuzz.sh) found, each with the input that found it: every one must now be
// a one-line fulcrum::Error (error_of catches only those: anything else thrown fails the test).
#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "eplb/json_text.hpp"
#include "eplb/loads.hpp"
#include "eplb/placement_io.hpp"
#include "model/qwen3_config.hpp"
#include "model/safetensors.hpp"
#include "model_test_util.hpp"
#include "tokenizer/tokenizer.hpp"
#include "tokenizer_test_util.hpp"

namespace fulcrum::test {
namespace {

// A string literal's bytes, NULs included.
template <size_t N>
std::string bytes(const char (&literal)[N]) {
  return std::string(literal, N - 1);
}

void expect_one_line(const std::string& message, const std::string& needle) {
  EXPECT_FALSE(message.empty()) << "no fulcrum::Error";
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  EXPECT_LT(message.size(), 400u) << message;
  EXPECT_NE(message.find(needle), std::string::npos) << "'" << needle << "' not in: " << message;
}

// A safetensors file of this JSON header: its 8-byte length, the header, 4 data bytes.
std::string file_of_header(const std::string& header) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + std::string(4, '\0');
}

// nlohmann's parser throws out_of_range (not parse_error) for a number beyond the double range; it escaped
// parse_json_text as a foreign exception from the loads, placement and config.json readers.
TEST(FuzzRegression, NumberBeyondTheDoubleRangeIsAOneLineErrorOfEveryJsonReader) {
  const std::string loads = bytes("22222e2222\x0d" "each,22\xd5" "2");  // fuzz_loads
  expect_one_line(error_of([&] { eplb::parse_loads_json(loads, "loads.json"); }), "loads.json: number overflow");
  const std::string placement = bytes(  // fuzz_placement
      "{\x22ph22222221405284674675al_experts\x22: 100944430e61140548num_no2des2674675al_experts\x22: 117,[[, \x22"
      "0}, 1U\x01\x00\x00\x00\x00\x00\x00\x00]}");
  expect_one_line(error_of([&] { eplb::parse_placement_json(placement, "p.json"); }), "p.json: number overflow");
  const std::string config = bytes(  // fuzz_config
      "{\x22" "4k3_s474872#\x22:2222222000.00000000000000000000e0000200000000000000000000000000neag\x22i\xff\xff"
      "936634307741923 2(\xff\xffmd\x22" "4k3_s474872#ep\x22:(47");
  const std::string message = error_of([&] { eplb::parse_json_text(config, "config.json"); });
  expect_one_line(message, "config.json: number overflow");
  EXPECT_EQ(message.find("[json.exception"), std::string::npos) << message;
  // The smallest case, and the offending token cut like a parse error's.
  expect_one_line(error_of([] { eplb::parse_json_text("[1e400]", "x.json"); }), "x.json: number overflow parsing '1e400'");
  expect_one_line(error_of([] { eplb::parse_json_text("[1" + std::string(5000, '0') + "e400]", "x.json"); }),
                  "x.json: number overflow");
}

// A CSV field that is not a number was quoted whole, raw bytes and all (fuzz_loads: a 1 KiB binary line).
TEST(FuzzRegression, LoadsCsvQuotesABadFieldPrintableAndCut) {
  const std::string message = error_of([] { eplb::parse_loads_csv("{\"x\xff" + std::string(2000, 'b'), "l.csv"); });
  expect_one_line(message, "l.csv:1 column 1: '{\"x\\xff" + std::string(60, 'b') + "...' is not a number");
}

// A tensor name holding "\n" (the JSON escape) made the header's errors several lines (fuzz_safetensors_header).
TEST(FuzzRegression, SafetensorsNamesWithControlCharactersOrOverlongAreRefusedAtOpen) {
  TempDir dir("fuzz_regression");
  const auto open_error = [&](const std::string& file_bytes) {
    const std::string path = dir.file("x.safetensors");
    std::ofstream(path, std::ios::binary) << file_bytes;
    return error_of([&] { model::SafetensorsFile file(path); });
  };
  const std::string found = bytes(
      "=\x01\x00\x00\x00\x00\x00\x00{\x22seq0.greeseq1.greedy_tok\x5cns\x22: {\x22" "dtype\x22: \x22I00\x22, \x22"
      "shape\x22: [8], \x22" "dl; last read: [104, 168]}, fsets\x22: [168, 320]}}\x00\x00\x00\x00\x00\x00\x00\x00"
      "\x00\x00\x00\x00\x00\x00\x05\x00" "0]}}\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"
      "\x00\x00\x00\x00" "eq1.greedy_tok\x5cns\x22: {\x22" "dtype\x22: \x22I00\x22, \x22shape\x22: [8], \x22"
      "dl; last read: [104, 168]}, fsets\x22: [168, 320]}}\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"
      "\x05\x00" "0]}}\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"
      "\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00");
  expect_one_line(open_error(found), "tensor name 'seq0.greeseq1.greedy_tok\\x0as' holds a control character");
  const std::string entry = R"({"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})";
  expect_one_line(open_error(file_of_header(R"({"a\u0007": )" + entry + "}")), "holds a control character");
  expect_one_line(open_error(file_of_header("{\"" + std::string(513, 'w') + "\": " + entry + "}")),
                  "or is over 512 bytes");
  expect_one_line(open_error(file_of_header(R"({"__metadata__": {"k\r": "v"}})")),
                  "__metadata__ key 'k\\x0d' holds a control character");
  // Names up to the limit still open.
  const std::string path = dir.file("ok.safetensors");
  std::ofstream(path, std::ios::binary) << file_of_header("{\"" + std::string(512, 'w') + "\": " + entry + "}");
  EXPECT_EQ(model::SafetensorsFile(path).names().size(), 1u);
}

// A vocab id 1.6e34 was converted to int64 (undefined behaviour, UBSan in fuzz_tokenizer_json); ids are now
// integers below kMaxTokenIds, and the names quoted in errors are printable.
TEST(FuzzRegression, TokenizerIdsMustBeIntegersInRangeAndErrorsQuoteNoRawBytes) {
  const auto build_error = [](const nlohmann::json& spec) {
    return error_of([&] { tokenizer::Tokenizer::from_json(spec, "tokenizer.json"); });
  };
  nlohmann::json spec = tiny_byte_level_spec({});
  spec["model"]["vocab"]["\u00a1"] = 1.6777777777777777e34;  // the fuzzer's value, for byte 0xa1's token
  expect_one_line(build_error(spec), "vocab id of '\\xc2\\xa1' is not an integer: 1.6777777777777777e+34");
  spec = tiny_byte_level_spec({});
  spec["model"]["vocab"]["zz"] = int64_t{1} << 30;
  expect_one_line(build_error(spec), "vocab id 1073741824 of 'zz' is outside [0, 16777216)");
  spec = tiny_byte_level_spec({});
  spec["added_tokens"] = {{{"id", 2147483647}, {"content", "<x>"}}};  // id + 1 overflowed int
  expect_one_line(build_error(spec), "added token id 2147483647 is not an integer in [0, 16777216)");
  spec["added_tokens"] = {{{"id", 3.5}, {"content", "<x>"}}};
  expect_one_line(build_error(spec), "added token id 3.5 is not an integer");
  spec = tiny_byte_level_spec({});
  spec["model"]["type"] = "BPE\nx";
  expect_one_line(build_error(spec), "unsupported model type 'BPE\\x0ax'");
  spec = tiny_byte_level_spec({});
  spec["model"]["merges"] = {"a\nb"};
  expect_one_line(build_error(spec), "merge 'a\\x0ab' is not two tokens");
}

// config.json strings were quoted raw (fuzz_config: model_type "qw\n3_moe" made a two-line error), and the
// quantization_config values whole (a long array, or invalid UTF-8, whose dump() throws a foreign exception); the
// same for a safetensors dtype.
TEST(FuzzRegression, ConfigAndSafetensorsStringsInErrorsArePrintableAndCut) {
  const nlohmann::json base = nlohmann::json::parse(slurp(golden_model_dir("qwen3moe-tiny-fp8") + "/config.json"));
  const auto config_error = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json config = base;
    edit(config);
    return error_of([&] { model::parse_qwen3_moe_config(config, "config.json"); });
  };
  expect_one_line(config_error([](auto& c) { c["model_type"] = "qw\n3_moe"; }),
                  "unsupported model type 'qw\\x0a3_moe'");
  expect_one_line(config_error([](auto& c) { c["hidden_act"] = "si\rlu"; }), "unsupported activation 'si\\x0dlu'");
  expect_one_line(config_error([](auto& c) { c["model_type"] = std::string(5000, 'q'); }), "...' (expected qwen3_moe)");
  expect_one_line(config_error([](auto& c) { c["quantization_config"] = std::vector<int>(2000, 7); }),
                  "must be an object, got [7,7,7");
  expect_one_line(config_error([](auto& c) { c["quantization_config"]["fmt"] = std::string("e4\xffm3"); }),
                  "key 'quantization_config.fmt': unsupported value");
  expect_one_line(
      config_error([](auto& c) { c["quantization_config"]["weight_block_size"] = std::vector<int>(2000, 1); }),
      "unsupported block size [1,1,1");
  TempDir dir("fuzz_regression_dtype");
  const std::string header = R"({"t": {"dtype": "F\n32", "shape": [1], "data_offsets": [0, 4]}})";
  const std::string path = dir.file("dtype.safetensors");
  std::ofstream(path, std::ios::binary) << file_of_header(header);
  expect_one_line(error_of([&] { model::SafetensorsFile f(path); }), "unsupported dtype 'F\\x0a32'");
  // A sharded checkpoint's index names its tensors too.
  std::ofstream(dir.file("model.safetensors.index.json")) << R"({"weight_map": {"a\nb": 3}})";
  expect_one_line(error_of([&] { model::Checkpoint c(dir.path()); }),
                  "weight_map entry of 'a\\x0ab' must be a file name");
}

}  // namespace
}  // namespace fulcrum::test
