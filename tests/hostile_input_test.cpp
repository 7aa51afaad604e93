// Hostile inputs to every parser and size flag (issue 15): a one-line error, never a crash or a runaway allocation.
#include <cstring>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "eplb/json_text.hpp"
#include "eplb/loads.hpp"
#include "eplb/placement_io.hpp"
#include "eplb/planner.hpp"
#include "model/qwen3_config.hpp"
#include "model/safetensors.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

constexpr int kDeep = 100000;  // deep enough to overflow a recursive parser's stack

std::string deep(int levels, char open = '[') { return std::string(static_cast<size_t>(levels), open); }

void write_file(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// One line on stderr naming `needle`, a non-zero exit (not a signal), short enough to read.
void expect_short_one_line_error(const CliRun& run, const std::string& needle) {
  EXPECT_GT(run.exit_code, 0) << run.err.substr(0, 300);
  EXPECT_LT(run.exit_code, 128) << "killed by a signal";
  EXPECT_EQ(run.err.rfind("fulcrum: error: ", 0), 0u) << run.err.substr(0, 300);
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err.substr(0, 300);
  EXPECT_LT(run.err.size(), 400u) << run.err.substr(0, 300);
  EXPECT_NE(run.err.find(needle), std::string::npos) << "'" << needle << "' not in: " << run.err.substr(0, 300);
}

TEST(JsonDepth, ScanCountsBracketsOutsideStringsOnly) {
  EXPECT_EQ(eplb::find_json_depth_overflow("[[1], {\"a\": [2]}]", 3), std::nullopt);
  EXPECT_EQ(eplb::find_json_depth_overflow("[[1], {\"a\": [2]}]", 2), 12u);
  EXPECT_EQ(eplb::find_json_depth_overflow("[[1], {\"a\": [2]}]", 1), 1u);
  EXPECT_EQ(eplb::find_json_depth_overflow("{\"a\": {\"b\": 1}}", 1), 6u);
  // Brackets in strings, escaped quotes and backslashes do not count.
  EXPECT_EQ(eplb::find_json_depth_overflow("[\"[[[{{{\", \"\\\"[[[\", \"\\\\\"]", 1), std::nullopt);
  EXPECT_EQ(eplb::find_json_depth_overflow("[\"\\\\\", [1]]", 1), 7u);
  // Unbalanced closers never make depth negative; exactly the limit is accepted.
  EXPECT_EQ(eplb::find_json_depth_overflow("]]]][[", 1), 5u);
  EXPECT_EQ(eplb::find_json_depth_overflow(deep(eplb::kMaxJsonDepth) + std::string(eplb::kMaxJsonDepth, ']')),
            std::nullopt);
  EXPECT_EQ(eplb::find_json_depth_overflow(deep(kDeep)), static_cast<size_t>(eplb::kMaxJsonDepth));
}

TEST(JsonDepth, ParseJsonTextRefusesDeepNestingInOneShortLine) {
  const std::string message = error_of([] { eplb::parse_json_text(deep(kDeep, '{'), "x.json"); });
  EXPECT_EQ(message, "x.json: JSON nested deeper than 256 levels (at byte 256)");
  // 256 levels parse; 257 do not.
  const std::string ok = deep(eplb::kMaxJsonDepth) + std::string(eplb::kMaxJsonDepth, ']');
  EXPECT_TRUE(eplb::parse_json_text(ok, "ok.json").is_array());
  EXPECT_NE(error_of([&] { eplb::parse_json_text("[" + ok + "]", "y.json"); }).find("deeper than 256"),
            std::string::npos);
}

TEST(JsonDepth, ParseErrorsQuoteAFewDozenBytesAtMost) {
  // An unterminated megabyte string: nlohmann quotes the whole token as "last read".
  const std::string message = error_of([] { eplb::parse_json_text("[\"" + std::string(1 << 20, 'a'), "s.json"); });
  EXPECT_NE(message.find("s.json: "), std::string::npos) << message;
  EXPECT_LT(message.size(), 200u) << message.substr(0, 300);
  EXPECT_EQ(message.find('\n'), std::string::npos);
  // A long wrong-typed value in a field is cut too.
  const std::string field = error_of([] {
    eplb::parse_placement_json(R"({"num_gpus": ")" + std::string(100000, 'g') + R"(", "physical_to_logical_map": [[0]]})",
                               "p.json");
  });
  EXPECT_NE(field.find("\"num_gpus\" must be an integer"), std::string::npos) << field.substr(0, 300);
  EXPECT_LT(field.size(), 200u) << field.substr(0, 300);
}

TEST(JsonDepth, DeepLoadsAndPlacementFilesAreOneLineErrorsOfPlan) {
  TempDir dir("deep_json");
  write_file(dir.file("deep_loads.json"), "{\"logical_count\": " + deep(kDeep));
  expect_short_one_line_error(run_cli(dir, "plan --loads " + dir.file("deep_loads.json") + " --gpus 2 --physical-experts 4"),
                              "deep_loads.json: JSON nested deeper than 256 levels");
  write_file(dir.file("loads.csv"), "1,2,3,4\n");
  write_file(dir.file("deep_placement.json"), "{\"physical_to_logical_map\": " + deep(kDeep));
  expect_short_one_line_error(run_cli(dir, "plan --loads " + dir.file("loads.csv") + " --gpus 2 --physical-experts 4 --current " +
                                               dir.file("deep_placement.json")),
                              "deep_placement.json: JSON nested deeper than 256 levels");
  // 50k deep used to give a 100 KB line.
  write_file(dir.file("half.json"), "{\"logical_count\": " + deep(kDeep / 2) + std::string(kDeep / 2, ']') + "}");
  expect_short_one_line_error(run_cli(dir, "plan --loads " + dir.file("half.json") + " --gpus 2 --physical-experts 4"),
                              "half.json: JSON nested deeper than 256 levels");
}

TEST(JsonDepth, DeepConfigAndSafetensorsHeaderAreOneLineErrorsOfGenerateAndServe) {
  TempDir dir("deep_model");
  const std::string bad_config = dir.file("bad_config");
  std::filesystem::create_directories(bad_config);
  write_file(bad_config + "/config.json", "{\"num_experts\": " + deep(kDeep, '{'));
  expect_short_one_line_error(run_cli(dir, "generate --model " + bad_config + " --prompt-tokens 1"),
                              "config.json: JSON nested deeper than 256 levels");
  expect_short_one_line_error(run_cli(dir, "serve --model " + bad_config + " --port 0"),
                              "config.json: JSON nested deeper than 256 levels");
  EXPECT_NE(error_of([&] { model::load_qwen3_moe_config(bad_config); }).find("deeper than 256"), std::string::npos);

  // A good config beside a safetensors file whose header nests a tensor's shape 100k deep.
  const std::string bad_weights = dir.file("bad_weights");
  std::filesystem::create_directories(bad_weights);
  std::filesystem::copy_file(golden_model_dir("qwen3moe-tiny-128e") + "/config.json", bad_weights + "/config.json");
  const std::string header = "{\"w\": {\"dtype\": \"F32\", \"shape\": " + deep(kDeep) + ", \"data_offsets\": [0, 4]}}";
  std::string file(8, '\0');
  const uint64_t header_size = header.size();
  std::memcpy(file.data(), &header_size, 8);
  file += header + std::string(4, '\0');
  write_file(bad_weights + "/model.safetensors", file);
  const std::string message = error_of([&] { model::SafetensorsFile st(bad_weights + "/model.safetensors"); });
  EXPECT_NE(message.find("model.safetensors: header: JSON nested deeper than 256 levels"), std::string::npos) << message;
  expect_short_one_line_error(run_cli(dir, "generate --model " + bad_weights + " --prompt-tokens 1"),
                              "JSON nested deeper than 256 levels");
}

TEST(PlanSizes, PhysicalExpertsAreBoundedBeforeAnythingIsAllocated) {
  TempDir dir("plan_sizes");
  write_file(dir.file("loads.csv"), "1,2,3,4\n5,6,7,8\n");
  const std::string plan = "plan --loads " + dir.file("loads.csv");
  // 4 logical experts on 2 GPUs: at most 64 x 4 = 256 slots per layer.
  expect_short_one_line_error(run_cli(dir, plan + " --gpus 2 --physical-experts 2000000000"),
                              "physical experts (2000000000) must be at most 64 x max(logical experts 4, GPUs 2) = 256");
  expect_short_one_line_error(run_cli(dir, plan + " --gpus 2 --physical-experts 258"), "= 256 and at most 1048576");
  EXPECT_EQ(run_cli(dir, plan + " --gpus 2 --physical-experts 256 --json").exit_code, 0);
  // More GPUs than experts: 64 slots per GPU, and never more than 2^20.
  EXPECT_EQ(run_cli(dir, plan + " --gpus 8 --physical-experts 512 --json").exit_code, 0);
  expect_short_one_line_error(run_cli(dir, plan + " --gpus 8 --physical-experts 520"), "max(logical experts 4, GPUs 8) = 512");
  expect_short_one_line_error(run_cli(dir, plan + " --gpus 2000000000 --physical-experts 2000000000"),
                              "and at most 1048576");
  expect_short_one_line_error(run_cli(dir, plan + " --gpus 4 --nodes 1000000 --physical-experts 8"),
                              "num_gpus (4) must be divisible by num_nodes (1000000)");
  // The absolute cap (2^20 slots) and the whole-map cap (2^26 entries), on the planner itself.
  eplb::LoadMatrix wide;
  wide.num_layers = 1;
  wide.num_logical_experts = 1 << 19;
  wide.values.assign(size_t{1} << 19, 1.0);
  eplb::PlanOptions options;
  options.topology = {(1 << 20) + 2, 2, 1};
  EXPECT_NE(error_of([&] { eplb::make_planner("fulcrum")->plan(wide, options); }).find("and at most 1048576"),
            std::string::npos);
  eplb::LoadMatrix tall;  // 65 layers x 2^20 slots: just over 2^26 map entries
  tall.num_layers = 65;
  tall.num_logical_experts = 1 << 14;
  tall.values.assign(size_t{65} << 14, 1.0);
  options.topology = {1 << 20, 2, 1};
  EXPECT_EQ(error_of([&] { eplb::make_planner("fulcrum")->plan(tall, options); }),
            "65 layers x 1048576 physical experts must be positive and at most 67108864 map entries");
}

TEST(PlacementFile, HeaderFieldsThatDisagreeWithTheMapAreErrors) {
  const std::string map = R"("physical_to_logical_map": [[0, 1, 2, 3], [3, 2, 1, 0]])";
  EXPECT_EQ(eplb::parse_placement_json("{" + map + R"(, "num_gpus": 2})", "p.json").num_physical_experts(), 4);
  EXPECT_EQ(error_of([&] { eplb::parse_placement_json("{" + map + R"(, "num_physical_experts": 8})", "p.json"); }),
            "p.json: \"num_physical_experts\" = 8 but physical_to_logical_map has 4 slots per layer");
  EXPECT_EQ(error_of([&] { eplb::parse_placement_json("{" + map + R"(, "num_gpus": 3})", "p.json"); }),
            "p.json: physical experts (4) must be a positive multiple of num_gpus (3)");
  EXPECT_EQ(error_of([&] { eplb::parse_placement_json("{" + map + R"(, "num_gpus": 2, "num_nodes": 4})", "p.json"); }),
            "p.json: num_gpus (2) must be divisible by num_nodes (4)");
  EXPECT_EQ(error_of([&] {
              eplb::parse_placement_json("{" + map + R"(, "num_logical_experts": 3, "logical_count": [[1, 1, 1, 1], [1, 1, 1, 1]]})",
                                         "p.json");
            }),
            "p.json: \"num_logical_experts\" = 3 but logical_count has 4 experts per layer");
  // More experts claimed than the map has slots for.
  EXPECT_EQ(error_of([&] { eplb::parse_placement_json("{" + map + R"(, "num_logical_experts": 5})", "p.json"); }),
            "p.json: physical experts (4) must be at least the number of logical experts (5)");
  // The CLI reads it the same way (plan --current).
  TempDir dir("placement_file");
  write_file(dir.file("loads.csv"), "1,2,3,4\n5,6,7,8\n");
  write_file(dir.file("p.json"), "{" + map + R"(, "num_gpus": 2, "num_physical_experts": 6})");
  expect_short_one_line_error(run_cli(dir, "plan --loads " + dir.file("loads.csv") + " --gpus 2 --physical-experts 4 --current " +
                                               dir.file("p.json")),
                              "\"num_physical_experts\" = 6 but physical_to_logical_map has 4 slots per layer");
}

TEST(ServeFlags, ShutdownTimeoutMustBeAFiniteNumberZeroOrMore) {
  TempDir dir("serve_flags");
  const std::string serve = "serve --model " + golden_model_dir("qwen3moe-tiny-128e") + " --port 0 --shutdown-timeout ";
  expect_short_one_line_error(run_cli(dir, serve + "-5"), "--shutdown-timeout: must be zero or more, got -5");
  expect_short_one_line_error(run_cli(dir, serve + "nan"), "--shutdown-timeout: 'nan' is not a number");
  expect_short_one_line_error(run_cli(dir, serve + "inf"), "--shutdown-timeout: must be a finite number, got inf");
  expect_short_one_line_error(run_cli(dir, serve + "1e999"), "'1e999' is not a number");
}

}  // namespace
}  // namespace fulcrum::test
