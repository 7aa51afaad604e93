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

inline std::string golden_model_dir(const std::string& name) { return shared_path("golden/hf/" + name); }

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
