#include "comm/local_ranks.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "comm/exec_image.hpp"
#include "comm/tcp_socket.hpp"
#include "eplb/error.hpp"

namespace fulcrum::comm {
namespace {

constexpr const char* kLocalRankEnv = "FULCRUM_LOCAL_RANK";  // "rank size port"

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
    const ExecImage image = exec_image(argv, {{kLocalRankEnv, fmt::format("{} {} {}", r, n, port)}});
    const pid_t pid = ::fork();
    if (pid == 0) exec_self(image, launcher);
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
