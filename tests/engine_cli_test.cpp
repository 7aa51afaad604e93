// `fulcrum generate` with the parallel flags: the seeds' configuration and a planned placement file print
// the plain run's tokens; impossible layouts and placements are one-line errors.
#include <gtest/gtest.h>

#include "engine_test_util.hpp"
#include "eplb/atomic_file.hpp"
#include "eplb/placement_io.hpp"

namespace fulcrum::test {
namespace {

const std::string kPrompts = " --prompt-tokens '3 17 250 9 41' --prompt-tokens '200' --prompt-tokens '0 8 99'";

// Each (flags, needle): `base + flags` exits 1 with one line "fulcrum: error: ..." naming the needle, and
// prints nothing on stdout.
void expect_one_line_errors(const TempDir& dir, const std::string& base,
                            const std::vector<std::pair<std::string, std::string>>& cases) {
  for (const auto& [flags, needle] : cases) {
    const CliRun run = run_cli(dir, base + flags);
    EXPECT_EQ(run.exit_code, 1) << flags;
    EXPECT_EQ(run.err.rfind("fulcrum: error: ", 0), 0u) << run.err;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
    EXPECT_NE(run.err.find(needle), std::string::npos) << flags << " -> " << run.err;
    EXPECT_EQ(run.out, "") << flags;
  }
}

TEST(EngineCli, SeedsConfigurationAndPlannedPlacementPrintThePlainTokens) {
  TempDir dir("engine_cli");
  const std::string base = "generate --model " + golden_model_dir(k128e) + " --max-new-tokens 6" + kPrompts;
  const CliRun plain = run_cli(dir, base);
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  ASSERT_EQ(tokens_of(plain.out).size() > 0, true);
  const CliRun seeds = run_cli(dir, base + " --tp 8 --dp 2 --enable-dp-attention --ep 8 --moe-a2a-backend alltoall "
                                          "--ep-num-redundant-experts 8 --ep-dispatch-algorithm static");
  ASSERT_EQ(seeds.exit_code, 0) << seeds.err;
  EXPECT_EQ(tokens_of(seeds.out), tokens_of(plain.out));
  EXPECT_NE(seeds.out.find("# layout: tp 8 (attention: 2 DP group(s) x 4 TP), ep 8"), std::string::npos) << seeds.out;

  eplb::write_placement_file(dir.file("placement.json"), planned_placement(k128e, 132, 4), nullptr);
  const CliRun planned = run_cli(dir, base + " --tp 4 --ep 4 --pp 2 --ep-num-redundant-experts 4 --ep-dispatch-algorithm "
                                            "balanced --init-expert-location " + dir.file("placement.json"));
  ASSERT_EQ(planned.exit_code, 0) << planned.err;
  EXPECT_EQ(tokens_of(planned.out), tokens_of(plain.out));
}

TEST(EngineCli, ImpossibleLayoutsAreOneLineErrors) {
  TempDir dir("engine_cli");
  const std::string base = "generate --model " + golden_model_dir(k128e) + " --max-new-tokens 2 --prompt-tokens '1 2'";
  eplb::write_placement_file(dir.file("p130.json"), planned_placement(k128e, 130, 2), nullptr);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --tp 3", "num_attention_heads 4 is not divisible by the attention TP size 3"},
      {" --tp 4 --ep 3", "--tp 4 is not divisible by --ep 3"},
      {" --tp 4 --dp 2", "--dp 2 needs --enable-dp-attention"},
      {" --pp 4", "--pp 4 exceeds the model's 3 layers"},
      {" --tp 2 --ep 2 --ep-num-redundant-experts 1", "129 physical experts per MoE layer (128 + 1 redundant) are not "
                                                       "divisible by --ep 2"},
      {" --tp 2 --ep 2 --init-expert-location " + dir.file("p130.json"),
       "130 slots on 2 GPUs; the model and EP group need 3 x 128, 128 slots on 2 GPUs"},
      {" --init-expert-location " + dir.file("missing.json"), "missing.json"},
  };
  expect_one_line_errors(dir, base, cases);
  const std::vector<std::pair<std::string, std::string>> sglang_cases = {
      {" --tp 4 --dp 2 --enable-dp-attention --ep 8", "--ep 8 exceeds --tp 4: --tp is the ranks of a stage"},
      {" --moe-a2a-backend flashinfer", "unknown --moe-a2a-backend 'flashinfer' (accepted: allgather, none, alltoall, "
                                        "deepep, mooncake, mori, nixl)"},
      {" --enable-deepep-moe --moe-a2a-backend allgather", "--enable-deepep-moe conflicts with --moe-a2a-backend allgather"},
  };
  expect_one_line_errors(dir, base, sglang_cases);
  for (const std::string unknown : {" --deepep-mode fast", " --disable-radix-cache", " --no-such-flag"}) {
    const CliRun run = run_cli(dir, base + unknown);  // generate has no radix-cache flag: serve does
    EXPECT_EQ(run.exit_code, 2) << unknown;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
    EXPECT_NE(run.err.find(unknown.substr(1, unknown.find(' ', 1) - 1)), std::string::npos) << run.err;
  }
}

// The seeds' EPLB configuration on 8 in-process ranks: rebalances happen (log lines), tokens are the plain
// run's, and the recorder dump is a loads file `fulcrum plan` reads.
TEST(EngineCli, SeedsEplbConfigurationRebalancesAndKeepsThePlainTokens) {
  TempDir dir("engine_cli");
  const std::string base = "generate --model " + golden_model_dir(k128e) + " --max-new-tokens 12" + kPrompts;
  const CliRun plain = run_cli(dir, base);
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const CliRun seeds = run_cli(
      dir, base + " --tp 8 --dp 2 --enable-dp-attention --ep 8 --moe-a2a-backend alltoall --enable-eplb "
                  "--ep-num-redundant-experts 8 --eplb-rebalance-num-iterations 5 --ep-dispatch-algorithm static "
                  "--expert-distribution-recorder-mode stat --expert-distribution-recorder-buffer-size 5 "
                  "--expert-distribution-dump " + dir.file("dump.json"));
  ASSERT_EQ(seeds.exit_code, 0) << seeds.err;
  EXPECT_EQ(seeds.err, "");
  EXPECT_EQ(tokens_of(seeds.out), tokens_of(plain.out));
  for (const char* line : {"# eplb: rebalance 0 at pass 5: MoE layers 0..2 (3 layers): balancedness ",
                           "# eplb: rebalance 1 at pass 10: ", "# eplb: 2 rebalances"}) {
    EXPECT_NE(seeds.out.find(line), std::string::npos) << line << "\n" << seeds.out;
  }
  const CliRun plan = run_cli(dir, "plan --loads " + dir.file("dump.json") + " --gpus 8 --physical-experts 136 --json");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_NE(plan.out.find("balancedness_mean"), std::string::npos) << plan.out;
}

// per_pass and per_token dumps (windows of passes, raw choices) are loads files `fulcrum plan` reads too.
TEST(EngineCli, PerPassAndPerTokenDumpsAreReadByPlan) {
  TempDir dir("engine_cli");
  for (const std::string mode : {"per_pass", "per_token"}) {
    const std::string dump = dir.file(mode + ".json");
    const CliRun gen = run_cli(dir, "generate --model " + golden_model_dir(k128e) + " --max-new-tokens 4" + kPrompts +
                                        " --tp 2 --ep 2 --pp 3 --enable-eplb --eplb-rebalance-num-iterations 2 "
                                        "--eplb-rebalance-layers-per-chunk 1 --expert-distribution-recorder-mode " +
                                        mode + " --expert-distribution-dump " + dump);
    ASSERT_EQ(gen.exit_code, 0) << mode << ": " << gen.err;
    EXPECT_NE(gen.out.find("# eplb: rebalance 0 at pass 2: MoE layers 0..0 (1 layers)"), std::string::npos) << gen.out;
    EXPECT_NE(gen.out.find("MoE layers 1..1 (1 layers)"), std::string::npos) << gen.out;
    const CliRun plan = run_cli(dir, "plan --loads " + dump + " --gpus 2 --physical-experts 128");
    EXPECT_EQ(plan.exit_code, 0) << mode << ": " << plan.err;
  }
}

// Sampling flags: a seed gives the same tokens on every run and layout; EPLB on one EP rank is refused loudly.
TEST(EngineCli, SeededSamplingAndEplbOnOneRankIsReported) {
  TempDir dir("engine_cli");
  const std::string base = "generate --model " + golden_model_dir(k128e) + " --max-new-tokens 6" + kPrompts +
                           " --temperature 0.8 --top-p 0.9 --top-k 50 --seed 5";
  const CliRun one = run_cli(dir, base + " --enable-eplb");
  ASSERT_EQ(one.exit_code, 0) << one.err;
  EXPECT_NE(one.err.find("fulcrum: warning: --enable-eplb: EPLB disabled: a single EP rank"), std::string::npos)
      << one.err;
  const CliRun four = run_cli(dir, base + " --tp 4 --ep 4 --ep-num-redundant-experts 4 --enable-eplb "
                                          "--eplb-rebalance-num-iterations 1");
  ASSERT_EQ(four.exit_code, 0) << four.err;
  EXPECT_EQ(tokens_of(four.out), tokens_of(one.out));
  const CliRun greedy = run_cli(dir, "generate --model " + golden_model_dir(k128e) + " --max-new-tokens 6" + kPrompts);
  EXPECT_NE(tokens_of(greedy.out), tokens_of(one.out));
  const CliRun unused = run_cli(dir, "generate --model " + golden_model_dir(k128e) +
                                         " --max-new-tokens 1 --prompt-tokens 1 --eplb-rebalance-num-iterations 3");
  EXPECT_NE(unused.err.find("--eplb-rebalance-num-iterations has no effect without --enable-eplb"), std::string::npos)
      << unused.err;
  // A GPU-engine flag on the CPU: said, and the run is the plain one.
  const CliRun gpu_flag = run_cli(dir, "generate --model " + golden_model_dir(k128e) + " --max-new-tokens 6" + kPrompts +
                                           " --fp8-dense-gemms");
  ASSERT_EQ(gpu_flag.exit_code, 0) << gpu_flag.err;
  EXPECT_NE(gpu_flag.err.find("fulcrum: warning: --fp8-dense-gemms has no effect without --device cuda"), std::string::npos)
      << gpu_flag.err;
  EXPECT_EQ(tokens_of(gpu_flag.out), tokens_of(greedy.out));
}

TEST(EngineCli, BadEplbAndSamplingValuesAreOneLineErrors) {
  TempDir dir("engine_cli");
  const std::string base = "generate --model " + golden_model_dir(k128e) + " --max-new-tokens 2 --prompt-tokens '1 2'" +
                           " --tp 2 --ep 2 --enable-eplb";
  write_file_atomically(dir.file("loads.csv"), "1,2,3\n");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --expert-distribution-recorder-mode per_layer", "per_layer"},
      {" --expert-distribution-recorder-buffer-size 0", "--expert-distribution-recorder-buffer-size must be positive"},
      {" --eplb-rebalance-num-iterations 0", "--eplb-rebalance-num-iterations must be positive"},
      {" --eplb-rebalance-layers-per-chunk -1", "--eplb-rebalance-layers-per-chunk must be >= 0"},
      {" --ep-num-redundant-experts 3", "131 physical experts per MoE layer (128 + 3 redundant) are not divisible by --ep 2"},
      {" --init-expert-location " + dir.file("loads.csv"), "loads are 1 MoE layers x 3 experts, the model has 3 x 128"},
      {" --temperature -1", "temperature"},
      {" --top-p 0", "top_p"},
      {" --greedy --temperature 0.5", "--greedy conflicts with --temperature"},
  };
  expect_one_line_errors(dir, base, cases);
}

}  // namespace
}  // namespace fulcrum::test
