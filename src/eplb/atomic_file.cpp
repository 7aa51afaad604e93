#include "eplb/atomic_file.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>

#include <unistd.h>

#include "eplb/error.hpp"

namespace fulcrum {
namespace {

// The temporary files being written; a file is created under the lock, so abandon_atomic_writes() sees it.
struct WritesInProgress {
  std::mutex mutex;
  std::set<std::string> temps;
  bool abandoned = false;
};

WritesInProgress& writes_in_progress() {
  static WritesInProgress* writes = new WritesInProgress;  // never destroyed: usable until the process ends
  return *writes;
}

struct ForgetTemp {
  std::string temp;
  ~ForgetTemp() {
    WritesInProgress& w = writes_in_progress();
    std::lock_guard lock(w.mutex);
    w.temps.erase(temp);
  }
};

}  // namespace

void abandon_atomic_writes() {
  WritesInProgress& w = writes_in_progress();
  std::lock_guard lock(w.mutex);
  w.abandoned = true;
  for (const std::string& temp : w.temps) ::unlink(temp.c_str());
}

void write_file_atomically(const std::string& path, const std::string& contents) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path temp = target.parent_path() / fmt::format(".{}.tmp.{}", target.filename().string(), ::getpid());
  const ForgetTemp forget{temp.string()};
  {
    std::ofstream out;
    {
      WritesInProgress& w = writes_in_progress();
      std::lock_guard lock(w.mutex);
      FULCRUM_CHECK(!w.abandoned, "{}: not written: the process is stopping", path);
      w.temps.insert(temp.string());
      out.open(temp, std::ios::binary | std::ios::trunc);
    }
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
