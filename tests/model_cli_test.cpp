// `fulcrum generate` end to end on the golden fixtures: the printed tokens are transformers' greedy
// tokens, --dump-logits writes transformers' prompt logits, and bad input is a one-line error.
#include <cmath>
#include <cstdlib>
#include <fstream>

#include <sys/wait.h>

#include <gtest/gtest.h>

#include "model/safetensors.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

std::string joined(const std::vector<int64_t>& ids) {
  std::string text;
  for (const int64_t id : ids) {
    if (!text.empty()) text += ' ';
    text += std::to_string(id);
  }
  return text;
}

TEST(ModelCli, GenerateMatchesGolden) {
  for (const char* name : {"qwen3moe-tiny-128e", "qwen3moe-tiny-dense-mix"}) {
    const std::string model_dir = golden_model_dir(name);
    const model::SafetensorsFile golden(model_dir + "/golden.safetensors");
    TempDir dir("cli");
    std::string args = "generate --model " + model_dir + " --device cpu --max-new-tokens 8 --greedy --dump-logits " +
                       dir.file("logits.safetensors");
    int num_sequences = 0;
    while (golden.contains("seq" + std::to_string(num_sequences) + ".input_ids")) {
      args += " --prompt-tokens '" + joined(golden.read_i64("seq" + std::to_string(num_sequences) + ".input_ids")) + "'";
      ++num_sequences;
    }
    const CliRun run = run_cli(dir, args);
    ASSERT_EQ(run.exit_code, 0) << run.err;
    const model::SafetensorsFile dumped(dir.file("logits.safetensors"));
    for (int i = 0; i < num_sequences; ++i) {
      const std::string seq = "seq" + std::to_string(i);
      // Every golden sequence here has a last-position margin above the 1e-3 near-tie threshold.
      EXPECT_NE(run.out.find(seq + ": " + joined(golden.read_i64(seq + ".greedy_tokens")) + "\n"), std::string::npos)
          << name << "\n" << run.out;
      const model::HostTensor mine = dumped.read_f32(seq + ".logits");
      const model::HostTensor theirs = golden.read_f32(seq + ".logits");
      ASSERT_EQ(mine.shape, theirs.shape);
      for (size_t j = 0; j < mine.data.size(); ++j) ASSERT_NEAR(mine.data[j], theirs.data[j], 1e-4f) << name << " " << seq;
    }
  }
}

TEST(ModelCli, GenerateErrorsAreOneLine) {
  TempDir dir("cli");
  const std::string model = "generate --model " + golden_model_dir("qwen3moe-tiny-128e");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {model + " --prompt-tokens '1 2' --device tpu", "unknown device 'tpu'"},
      {model + " --prompt-tokens '1 x'", "'x' is not a token id"},
      {model + " --prompt-tokens '1 256'", "token id 256 out of range [0, 256)"},
      {model + " --prompt-tokens ' '", "no token ids"},
      {"generate --model " + dir.path() + " --prompt-tokens 1", "config.json"},
  };
  for (const auto& [args, needle] : cases) {
    const CliRun run = run_cli(dir, args);
    EXPECT_NE(run.exit_code, 0) << args;
    EXPECT_EQ(run.err.rfind("fulcrum: error: ", 0), 0u) << run.err;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
    EXPECT_NE(run.err.find(needle), std::string::npos) << args << " -> " << run.err;
    EXPECT_EQ(run.out, "") << args;
  }
}

// --device cuda runs where there is CUDA (build and device); elsewhere it fails with a one-line reason.
TEST(ModelCli, GenerateOnCudaRunsOrSaysWhyNot) {
  TempDir dir("cli");
  const CliRun run =
      run_cli(dir, "generate --model " + golden_model_dir("qwen3moe-tiny-128e") + " --prompt-tokens '1 2' --device cuda");
  if (run.exit_code == 0) {
    EXPECT_NE(run.out.find("on cuda"), std::string::npos) << run.out;
    return;
  }
  EXPECT_EQ(run.err.rfind("fulcrum: error: ", 0), 0u) << run.err;
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  EXPECT_TRUE(run.err.find("no CUDA support") != std::string::npos || run.err.find("no CUDA device") != std::string::npos)
      << run.err;
}

}  // namespace
}  // namespace fulcrum::test
