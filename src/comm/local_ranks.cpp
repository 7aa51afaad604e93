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
#include <thread>

#include <fmt/format.h>

#include "comm/tcp_socket.hpp"
#include "eplb/error.hpp"

namespace fulcrum::comm {
namespace {

constexpr const char* kLocalRankEnv = "FULCRUM_LOCAL_RANK";  // "rank size port"

[[noreturn]] void exec_rank(const std::vector<std::string>& argv, pid_t launcher, const std::string& place) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the launcher dies: so does this rank
  if (::getppid() != launcher) ::_exit(1);
  ::setenv(kLocalRankEnv, place.c_str(), 1);
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);  // NVLink multicast stays off
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  ::execv("/proc/self/exe", args.data());
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
    const pid_t pid = ::fork();
    if (pid == 0) exec_rank(argv, launcher, fmt::format("{} {} {}", r, n, port));
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
