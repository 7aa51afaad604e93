#include "comm/local_ranks.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string_view>
#include <thread>

#include <fmt/format.h>

#include "comm/tcp_socket.hpp"
#include "eplb/error.hpp"

namespace fulcrum::comm {
namespace {

constexpr const char* kLocalRankEnv = "FULCRUM_LOCAL_RANK";  // "rank size port"

// A rank's argv and environment, built in the launcher before fork: in the child of a threaded process only
// async-signal-safe calls are safe until exec (no allocation, no formatting, no setenv).
struct ExecImage {
  std::vector<std::string> strings;  // the arguments, then the environment entries
  std::vector<char*> argv, envp;     // null-terminated pointers into strings
};

ExecImage exec_image(const std::vector<std::string>& argv, const std::string& place) {
  ExecImage image;
  image.strings = argv;
  const std::string rank_entry = std::string(kLocalRankEnv) + "=";
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    if (entry.starts_with(rank_entry) || entry.starts_with("NCCL_NVLS_ENABLE=")) continue;
    image.strings.emplace_back(entry);
  }
  image.strings.push_back(rank_entry + place);
  image.strings.push_back("NCCL_NVLS_ENABLE=0");  // NVLink multicast stays off
  for (size_t i = 0; i < image.strings.size(); ++i) {
    (i < argv.size() ? image.argv : image.envp).push_back(image.strings[i].data());
  }
  image.argv.push_back(nullptr);
  image.envp.push_back(nullptr);
  return image;
}

[[noreturn]] void exec_rank(const ExecImage& image, pid_t launcher) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the launcher dies: so does this rank
  if (::getppid() != launcher) ::_exit(1);
  ::execve("/proc/self/exe", image.argv.data(), image.envp.data());
  ::_exit(127);
}

}  // namespace

std::optional<LocalRank> local_rank() {
  const char* text = std::getenv(kLocalRankEnv);
  if (text == nullptr) return std::nullopt;
  LocalRank me;
  std::istringstream in(text);
  in >> me.rank >> me.size >> me.port;
  FULCRUM_CHECK(!in.fail() && me.rank >= 0 && me.rank < me.size && me.port > 0 && me.port <= 65535,
                "malformed {}='{}' (expected: rank size port)", kLocalRankEnv, text);
  return me;
}

std::vector<int> run_local_rank_processes(int n, const std::vector<std::string>& argv, std::chrono::seconds timeout) {
  FULCRUM_CHECK(n >= 1 && !argv.empty(), "run_local_rank_processes: {} ranks, {} arguments", n, argv.size());
  const int port = pick_free_port();
  const pid_t launcher = ::getpid();
  std::fflush(nullptr);  // nothing buffered is written twice by the children
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const ExecImage image = exec_image(argv, fmt::format("{} {} {}", r, n, port));
    const pid_t pid = ::fork();
    if (pid == 0) exec_rank(image, launcher);
    if (pid < 0) {
      const std::string reason = std::strerror(errno);
      for (const pid_t started : pids) {
        ::kill(started, SIGKILL);
        ::waitpid(started, nullptr, 0);
      }
      throw Error(fmt::format("cannot start rank process {}: fork failed: {}", r, reason));
    }
    pids.push_back(pid);
  }
  std::vector<int> statuses(n, -1);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int r = 0; r < n; ++r) {
    int status = 0;
    pid_t got = 0;
    while ((got = ::waitpid(pids[r], &status, WNOHANG)) == 0 || (got < 0 && errno == EINTR)) {
      if (std::chrono::steady_clock::now() > deadline) ::kill(pids[r], SIGKILL);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    statuses[r] = got > 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  return statuses;
}

}  // namespace fulcrum::comm
