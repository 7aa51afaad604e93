// The fulcrum binary end to end: JSON output, placement files, and one-line errors with non-zero exits.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "eplb/loads.hpp"
#include "eplb/placement_io.hpp"
#include "test_data.hpp"

namespace fulcrum {
namespace {

namespace fs = std::filesystem;

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("fulcrum_cli_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  RunResult run(const std::string& args) const {
    const fs::path out = dir_ / "stdout.txt", err = dir_ / "stderr.txt";
    const std::string cmd = std::string(FULCRUM_CLI_PATH) + " " + args + " >" + out.string() + " 2>" + err.string();
    const int status = std::system(cmd.c_str());
    RunResult r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = eplb::read_text_file(out.string());
    r.err = eplb::read_text_file(err.string());
    return r;
  }
  std::string write(const std::string& name, const std::string& text) const {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }
  fs::path dir_;
};

// One line on stderr, starting "fulcrum: error: ", containing `needle`; non-zero exit; nothing on stdout.
void expect_one_line_error(const RunResult& r, const std::string& needle) {
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(r.err.rfind("fulcrum: error: ", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << "'" << needle << "' not in: " << r.err;
}

const std::string kRealLoads = test::shared_path("data/loads/qwen3-30b-a3b_prefill_arc_en.csv");

TEST_F(CliTest, PlanJsonHasTheReportedFields) {
  const RunResult r = run("plan --loads " + kRealLoads + " --gpus 16 --physical-experts 160 --algorithm deepseek --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc["algorithm"], "deepseek");
  EXPECT_EQ(doc["balancedness_per_layer"].size(), 48u);
  for (const char* key : {"balancedness_mean", "balancedness_min", "lower_bound_balancedness_mean", "plan_seconds"}) {
    EXPECT_TRUE(doc[key].is_number()) << key;
  }
  EXPECT_LE(doc["balancedness_min"].get<double>(), doc["balancedness_mean"].get<double>());
  EXPECT_LE(doc["balancedness_mean"].get<double>(), doc["lower_bound_balancedness_mean"].get<double>() + 1e-12);
  EXPECT_FALSE(doc.contains("experts_moved"));
}

TEST_F(CliTest, HierarchicalPlanReportsNodeBalance) {
  const RunResult r = run("plan --loads " + kRealLoads + " --gpus 16 --physical-experts 160 --nodes 4 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc["num_nodes"], 4);
  EXPECT_GT(doc["node_balancedness_mean"].get<double>(), 0.99);
  EXPECT_GE(doc["nodes_per_expert_mean"].get<double>(), 1.0);
  EXPECT_LE(doc["nodes_per_expert_mean"].get<double>(), 4.0);
  // Flat plans have no node view.
  const RunResult flat = run("plan --loads " + kRealLoads + " --gpus 16 --physical-experts 160 --json");
  EXPECT_FALSE(nlohmann::json::parse(flat.out).contains("node_balancedness_mean"));
}

TEST_F(CliTest, PlanWritesAPlacementAndReplansFromIt) {
  const std::string placement = (dir_ / "placement.json").string();
  const std::string loads2 = test::shared_path("data/loads/qwen3-30b-a3b_prefill_ted_he.csv");
  RunResult r = run("plan --loads " + kRealLoads + " --loads " + loads2 +
                    " --gpus 8 --physical-experts 160 --algorithm deepseek --output " + placement);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const eplb::Placement p = eplb::read_placement_file(placement);
  EXPECT_EQ(p.num_layers, 48);
  EXPECT_EQ(p.topology.num_gpus, 8);
  // Same loads, from its own plan: deepseek is deterministic, so nothing moves.
  r = run("plan --loads " + kRealLoads + " --loads " + loads2 +
          " --gpus 8 --physical-experts 160 --algorithm deepseek --json --current " + placement);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["experts_moved"], 0);
}

TEST_F(CliTest, BadLoadsGiveOneLineErrorsAndNoOutputFile) {
  const std::string out = (dir_ / "never.json").string();
  const std::string common = " --gpus 2 --physical-experts 4 --algorithm deepseek --output " + out;
  expect_one_line_error(run("plan --loads " + write("nan.csv", "1,2,3\n1,nan,3\n") + common), "nan.csv:2 column 2");
  expect_one_line_error(run("plan --loads " + write("neg.csv", "1,-2,3\n") + common), "neg.csv:1 column 2");
  expect_one_line_error(run("plan --loads " + write("rag.csv", "1,2,3\n1,2\n") + common), "rag.csv:2: ragged");
  expect_one_line_error(run("plan --loads " + write("empty.csv", "# nothing\n") + common), "empty.csv: no load rows");
  expect_one_line_error(run("plan --loads " + write("bad.json", "{\"logical_count\": [[1, 2],") + common),
                        "bad.json: parse error at line 1");
  EXPECT_FALSE(fs::exists(out));
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << "temporary file left behind";
  }
}

TEST_F(CliTest, BadPlacementsAndFlagsGiveOneLineErrors) {
  const std::string loads = write("l.csv", "1,2,3\n4,5,6\n");
  const std::string missing = write("missing.json", R"({"physical_to_logical_map": [[0, 1, 1, 0], [0, 1, 2, 0]],
      "num_gpus": 2, "num_logical_experts": 3})");
  expect_one_line_error(run("plan --loads " + loads + " --gpus 2 --physical-experts 4 --current " + missing),
                        "layer 0: logical expert 2 has no replica");
  expect_one_line_error(run("plan --loads " + loads + " --gpus 3 --physical-experts 4"),
                        "physical experts (4) must be a positive multiple of num_gpus (3)");
  expect_one_line_error(run("plan --loads " + loads + " --gpus 2 --physical-experts 4 --frobnicate"), "--frobnicate");
  expect_one_line_error(run("plan --loads " + loads + " --gpus 2 --physical-experts 4 --algorithm magic"), "magic");
  expect_one_line_error(run("plan --loads " + (dir_ / "absent.csv").string() + " --gpus 2 --physical-experts 4"),
                        "absent.csv");
  expect_one_line_error(run("replan"), "unknown command 'replan'");
  // Number flags name their rule (CLI11's own check printed a 300-digit range that seemed to allow 0).
  const RunResult zero = run("plan --loads " + loads + " --gpus 0 --physical-experts 4");
  expect_one_line_error(zero, "--gpus: must be positive, got 0");
  EXPECT_LT(zero.err.size(), 100u) << zero.err;
  expect_one_line_error(run("plan --loads " + loads + " --gpus two --physical-experts 4"), "--gpus: 'two' is not a number");
  expect_one_line_error(run("simulate --trace " + loads + " --gpus 2 --physical-experts 4 --rebalance-every 1 --batch-tokens -1"),
                        "--batch-tokens: must be zero or more, got -1");
}

TEST_F(CliTest, BenchMoeChecksItsFlagsBeforeLookingForAGpu) {
  // The same one-line errors with and without CUDA in the build: the options are checked first.
  const std::string three = write("three.csv", "1,2,3\n4,5,6\n");
  std::string row;
  for (int e = 0; e < 128; ++e) {
    if (e > 0) row += ',';
    row += std::to_string(e + 1);
  }
  const std::string loads = write("loads.csv", row + "\n" + row + "\n");
  expect_one_line_error(run("bench moe --loads " + (dir_ / "absent.csv").string()), "absent.csv");
  expect_one_line_error(run("bench moe --loads " + three), "3 experts, the Qwen3 shapes have 128");
  expect_one_line_error(run("bench moe --loads " + loads + " --models qwen9"), "unknown model 'qwen9'");
  expect_one_line_error(run("bench moe --loads " + loads + " --ep 3"), "--ep 3 with --redundant 8");
  expect_one_line_error(run("bench moe --loads " + loads + " --gpus 3"), "--gpus 3 with --redundant 8");
  expect_one_line_error(run("bench moe --loads " + loads + " --json " + (dir_ / "no" / "r.json").string()),
                        "does not exist");
  expect_one_line_error(run("bench moe --loads " + loads + " --loads-layer 5"), "--loads-layer 5 but");
  expect_one_line_error(run("bench moe --loads " + loads + " --loads-layer -5"), "--loads-layer -5: a layer index");
  expect_one_line_error(run("bench moe --loads " + loads + " --gpus 0"), "--gpus");
  expect_one_line_error(run("bench moe --loads " + loads + " --torch-peer " + (dir_ / "absent.py").string()),
                        "--torch-peer " + (dir_ / "absent.py").string() + ": no such file");
  expect_one_line_error(run("bench moe"), "--loads");
}

TEST_F(CliTest, SimulateReplaysAWindowTraceAsJson) {
  // Three windows of 2 layers x 4 experts: a hot expert that moves from 2 to 3. The trivial placement
  // (slots 0..5 hold experts 0 1 2 3 0 1) has one replica of expert 2.
  const std::string trace = write("trace.json", R"({"logical_count": [
      [[1, 1, 9, 1], [1, 1, 9, 1]], [[1, 1, 9, 1], [1, 1, 9, 1]], [[1, 1, 1, 9], [1, 1, 1, 9]]]})");
  const RunResult r = run("simulate --trace " + trace +
                          " --gpus 2 --physical-experts 6 --rebalance-every 1 --algorithm deepseek --dispatch balanced --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc["balancedness_per_window"].size(), 3u);
  EXPECT_EQ(doc["rebalance_windows"], nlohmann::json::parse("[1, 2]"));
  EXPECT_EQ(doc["experts_moved"].size(), 2u);
  const auto& per_window = doc["balancedness_per_window"];
  // Window 1 runs a plan made from window 0 (same loads): better than window 0's trivial placement.
  EXPECT_GT(per_window[1].get<double>(), per_window[0].get<double>());
  EXPECT_DOUBLE_EQ(doc["balancedness_min"].get<double>(),
                   std::min({per_window[0].get<double>(), per_window[1].get<double>(), per_window[2].get<double>()}));
}

TEST_F(CliTest, SimulateRejectsBadInput) {
  const std::string trace = write("t.csv", "1,2,3,4\n");
  const std::string common = " --gpus 2 --physical-experts 4 --algorithm deepseek";
  expect_one_line_error(run("simulate --trace " + trace + common + " --rebalance-every 1 --dispatch sideways"), "sideways");
  expect_one_line_error(run("simulate --trace " + trace + common + " --rebalance-every 0"), "--rebalance-every");
  expect_one_line_error(run("simulate --trace " + write("bad.csv", "1,2,3,inf\n") + common + " --rebalance-every 1"),
                        "bad.csv:1 column 4");
  expect_one_line_error(run("simulate --trace " + trace + " --trace " + write("other.csv", "1,2,3\n") + common +
                            " --rebalance-every 1"),
                        "");
}

TEST_F(CliTest, DemoPrintsTheTableAndWritesTheHeatmap) {
  const std::string svg = (dir_ / "heat.svg").string();
  const RunResult r = run("demo --planning --heatmap " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* needle : {"trivial", "deepseek", "fulcrum", "lower bound"}) {
    EXPECT_NE(r.out.find(needle), std::string::npos) << needle;
  }
  const std::string text = eplb::read_text_file(svg);
  EXPECT_EQ(text.rfind("<svg", 0), 0u);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n') > 48 * 32, true);  // one cell per layer and GPU, per panel
}

// The model demo (the main job): a synthetic model, EP 4 with live EPLB, tokens equal to the plain run's.
TEST_F(CliTest, ModelDemoRebalancesLiveAndPasses) {
  const RunResult r = run("demo --max-new-tokens 9");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("PASS: 16 of 16 sequences generate the same tokens"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("balancedness on the recorded loads"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" -> after (rebalanced) "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rebalance 0 at pass 4: MoE layers 0..3"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace fulcrum
