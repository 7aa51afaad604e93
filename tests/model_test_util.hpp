#pragma once
// Helpers shared by the model tests: temporary folders and the golden Hugging Face fixtures.
#include <filesystem>
#include <string>

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

inline std::string golden_model_dir(const std::string& name) { return shared_path("golden/hf/" + name); }

}  // namespace fulcrum::test
