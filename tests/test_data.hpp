#pragma once
// Paths to the shared golden data and real loads, and small helpers the tests share.
#include <algorithm>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "eplb/error.hpp"

namespace fulcrum::test {

inline std::string shared_path(const std::string& relative) { return std::string(FULCRUM_SHARED_DIR) + "/" + relative; }

// The 12 real Qwen3-30B-A3B load matrices (sorted by name).
inline std::vector<std::string> real_load_files() {
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(shared_path("data/loads"))) {
    if (entry.path().extension() == ".csv") files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Every golden DeepSeek EPLB case (sorted by name).
inline std::vector<std::string> golden_eplb_files() {
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(shared_path("golden/deepseek_eplb"))) {
    if (entry.path().extension() == ".json") files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// The message of the fulcrum::Error that `f` throws, or "" when it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace fulcrum::test
