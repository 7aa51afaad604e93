#pragma once
// Helpers shared by the model tests: temporary folders and the golden Hugging Face fixtures.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "test_data.hpp"

namespace fulcrum::test {

// A fresh folder under the system temp dir, removed when the object goes away.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    const std::string test = info ? std::string(info->test_suite_name()) + "." + info->name() : "none";
    path_ = std::filesystem::temp_directory_path() / ("fulcrum_" + tag + "_" + test + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

struct CliRun {
  int exit_code = -1;
  std::string out;
  std::string err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Runs the fulcrum binary with `args` (shell words), stdout and stderr captured in `dir`.
inline CliRun run_cli(const TempDir& dir, const std::string& args) {
  const std::string cmd = std::string(FULCRUM_CLI_PATH) + " " + args + " >" + dir.file("out.txt") + " 2>" + dir.file("err.txt");
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(dir.file("out.txt")), slurp(dir.file("err.txt"))};
}

// Two nodes on this host: `env1 fulcrum ARGS --node-rank 1` in the background while `env0 fulcrum ARGS
// --node-rank 0` runs in the foreground, as two users would start them. Returns {node 0, node 1}.
inline std::pair<CliRun, CliRun> run_cli_two_nodes(const TempDir& dir, const std::string& args, const std::string& env0 = "",
                                                   const std::string& env1 = "") {
  auto node = [&](int n, const std::string& env) {
    const std::string files = dir.file("n" + std::to_string(n));
    return env + " " + FULCRUM_CLI_PATH + " " + args + " --node-rank " + std::to_string(n) + " >" + files + ".out 2>" +
           files + ".err";
  };
  const std::string script = node(1, env1) + " & p=$!; " + node(0, env0) + "; r0=$?; wait $p; echo $r0 $? >" + dir.file("rc");
  EXPECT_EQ(std::system(script.c_str()), 0);
  std::istringstream rc(slurp(dir.file("rc")));
  std::pair<CliRun, CliRun> runs;
  rc >> runs.first.exit_code >> runs.second.exit_code;
  runs.first.out = slurp(dir.file("n0.out"));
  runs.first.err = slurp(dir.file("n0.err"));
  runs.second.out = slurp(dir.file("n1.out"));
  runs.second.err = slurp(dir.file("n1.err"));
  return runs;
}

inline std::string golden_model_dir(const std::string& name) { return shared_path("golden/hf/" + name); }

// The `fulcrum generate` command the GPU CLI tests extend with their layouts: three prompts on the golden tiny
// model, whose CPU one-rank tokens every GPU layout must print.
inline std::string tiny_generate_command() {
  return "generate --model " + golden_model_dir("qwen3moe-tiny-128e") +
         " --max-new-tokens 6 --prompt-tokens '3 17 250 9 41' --prompt-tokens '200' --prompt-tokens '0 8 99'";
}

// The "seqI: TOKENS" lines of a `fulcrum generate` output.
inline std::string tokens_of(const std::string& out) {
  std::string lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("seq", 0) == 0) lines += line + "\n";
  }
  return lines;
}

}  // namespace fulcrum::test
