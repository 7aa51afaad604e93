// `fulcrum generate` with the parallel flags: the seeds' configuration and a planned placement file print
// the plain run's tokens; impossible layouts and placements are one-line errors.
#include <gtest/gtest.h>

#include "engine_test_util.hpp"
#include "eplb/placement_io.hpp"

namespace fulcrum::test {
namespace {

const std::string kPrompts = " --prompt-tokens '3 17 250 9 41' --prompt-tokens '200' --prompt-tokens '0 8 99'";

std::string tokens_of(const std::string& out) {
  std::string lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("seq", 0) == 0) lines += line + "\n";
  }
  return lines;
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
       "the placement has 3 layers x 130 slots of 128 experts; this model and layout need 3 MoE layers x 128 slots"},
      {" --init-expert-location " + dir.file("missing.json"), "missing.json"},
  };
  for (const auto& [flags, needle] : cases) {
    const CliRun run = run_cli(dir, base + flags);
    EXPECT_EQ(run.exit_code, 1) << flags;
    EXPECT_EQ(run.err.rfind("fulcrum: error: ", 0), 0u) << run.err;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
    EXPECT_NE(run.err.find(needle), std::string::npos) << flags << " -> " << run.err;
    EXPECT_EQ(run.out, "") << flags;
  }
  const CliRun bad_backend = run_cli(dir, base + " --moe-a2a-backend deepep");
  EXPECT_NE(bad_backend.exit_code, 0);
  EXPECT_NE(bad_backend.err.find("--moe-a2a-backend"), std::string::npos) << bad_backend.err;
}

}  // namespace
}  // namespace fulcrum::test
