#pragma once
// Which processes are alive, read from /proc: the multi-process tests check that none of theirs is left behind.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace fulcrum::test {

// Processes whose command line mentions `needle` (a test's unique temporary folder or port).
inline int processes_mentioning(const std::string& needle) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "cmdline", std::ios::binary);
    const std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmdline.find(needle) != std::string::npos) ++count;
  }
  return count;
}

}  // namespace fulcrum::test
