#pragma once
// A real `fulcrum serve` process for integration tests: started on port 0, its port read from the
// "listening on" log line; stopped with SIGTERM (killed if it outlives the test).
#include <chrono>
#include <csignal>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "eplb/error.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {

// A child process of the CLI (`args` from the binary on), stdout and stderr in `log_file`; killed if it outlives
// the test.
class CliProcess {
 public:
  CliProcess(std::vector<std::string> args, const std::string& log_file) : log_file_(log_file) {
    pid_ = ::fork();
    FULCRUM_CHECK(pid_ >= 0, "fork failed");
    if (pid_ == 0) {
      const int fd = ::open(log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
  }
  ~CliProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  CliProcess(const CliProcess&) = delete;
  CliProcess& operator=(const CliProcess&) = delete;

  pid_t pid() const { return pid_; }
  std::string log() const { return slurp(log_file_); }
  // Polls (up to `timeout_s`) until the log holds `text`.
  bool wait_log(const std::string& text, double timeout_s = 30) const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::chrono::steady_clock::now() < deadline) {
      if (log().find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  // Waits (up to `timeout_s`) for the exit; returns the exit code (-1: did not exit or crashed).
  int wait_exit(double timeout_s = 30) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

 protected:
  std::string log_file_;
  pid_t pid_ = -1;
};

// `fulcrum serve --port 0` with `flags` (and `--model model_dir` unless empty).
inline std::vector<std::string> serve_args(const std::string& model_dir, const std::vector<std::string>& flags) {
  std::vector<std::string> args = {FULCRUM_CLI_PATH, "serve", "--port", "0"};
  if (!model_dir.empty()) args.insert(args.end(), {"--model", model_dir});
  args.insert(args.end(), flags.begin(), flags.end());
  return args;
}

class ServerProcess : public CliProcess {
 public:
  // An empty `model_dir` leaves the model flag to `flags` (e.g. SGLang's --model-path).
  ServerProcess(const std::string& model_dir, const std::vector<std::string>& flags, const std::string& log_file)
      : CliProcess(serve_args(model_dir, flags), log_file) {
    const std::regex listening("listening on http://[^ ]+:([0-9]+)");  // any --host; tests connect to 127.0.0.1
    for (int i = 0; i < 3000 && port_ == 0; ++i) {
      std::smatch m;
      const std::string log = slurp(log_file);
      if (std::regex_search(log, m, listening)) port_ = std::stoi(m[1]);
      int status = 0;
      FULCRUM_CHECK(::waitpid(pid_, &status, WNOHANG) == 0, "fulcrum serve exited early: {}", log);
      if (port_ == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    FULCRUM_CHECK(port_ > 0, "fulcrum serve did not start: {}", slurp(log_file));
  }
  int port() const { return port_; }
  // Resident set size of the process (VmRSS of /proc/PID/status), in KiB.
  int64_t rss_kib() const {
    const std::regex vm_rss("VmRSS:\\s+([0-9]+) kB");
    std::smatch m;
    const std::string status = slurp("/proc/" + std::to_string(pid_) + "/status");
    FULCRUM_CHECK(std::regex_search(status, m, vm_rss), "no VmRSS for process {}", pid_);
    return std::stoll(m[1]);
  }
  // Ranks as processes: the pid of world rank `rank`, from its "rank R (pid P) joined" log line (-1: none yet).
  pid_t rank_pid(int rank) const {
    const std::regex joined("rank " + std::to_string(rank) + " \\(pid ([0-9]+)\\) joined");
    std::smatch m;
    const std::string text = log();
    return std::regex_search(text, m, joined) ? static_cast<pid_t>(std::stol(m[1])) : -1;
  }
  // rank_pid once the rank has joined (polls up to 5 s; -1: it never did).
  pid_t wait_rank_pid(int rank) const {
    for (int i = 0; i < 500; ++i) {
      if (const pid_t pid = rank_pid(rank); pid > 0) return pid;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

  // SIGTERM, then waits (up to `timeout_s`) for the exit; returns the exit code (-1: did not exit or crashed).
  int terminate(double timeout_s = 30) {
    ::kill(pid_, SIGTERM);
    return wait_exit(timeout_s);
  }

 private:
  int port_ = 0;
};

// `fulcrum generate`'s greedy tokens for `prompts` (one batch) with `flags`.
inline std::vector<std::vector<int32_t>> generate_greedy(const std::string& model, const std::string& flags,
                                                         const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens) {
  TempDir dir("serve_eplb_generate");
  std::string args = "generate --model " + model + " " + flags + " --max-new-tokens " + std::to_string(max_new_tokens);
  for (const auto& p : prompts) args += " --prompt-tokens \"" + fmt::format("{}", fmt::join(p, " ")) + "\"";
  const CliRun run = run_cli(dir, args);
  EXPECT_EQ(run.exit_code, 0) << run.err;
  std::vector<std::vector<int32_t>> out(prompts.size());
  std::istringstream lines(run.out);
  for (std::string line; std::getline(lines, line);) {
    size_t idx = 0;
    if (std::sscanf(line.c_str(), "seq%zu:", &idx) != 1 || idx >= out.size()) continue;
    std::istringstream ids(line.substr(line.find(':') + 1));
    for (int32_t id; ids >> id;) out[idx].push_back(id);
  }
  return out;
}

// How many times `needle` occurs in `text` (log lines the multi-process tests count).
inline int count_of(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

}  // namespace fulcrum::test
