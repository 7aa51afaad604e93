#include "eplb/atomic_file.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <unistd.h>

#include "eplb/error.hpp"

namespace fulcrum {

void write_file_atomically(const std::string& path, const std::string& contents) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path temp = target.parent_path() / fmt::format(".{}.tmp.{}", target.filename().string(), ::getpid());
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    FULCRUM_CHECK(out.good(), "{}: cannot create output file", path);
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    out.flush();
    if (!out.good()) {
      std::error_code ignored;
      fs::remove(temp, ignored);
      throw Error(fmt::format("{}: write failed", path));
    }
  }
  std::error_code ec;
  fs::rename(temp, target, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(temp, ignored);
    throw Error(fmt::format("{}: cannot rename temporary file into place: {}", path, ec.message()));
  }
}

}  // namespace fulcrum
