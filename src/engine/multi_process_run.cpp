#include "engine/multi_process_run.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "comm/exec_image.hpp"
#include "comm/peer_mesh.hpp"
#include "comm/tcp_communicator.hpp"
#include "eplb/error.hpp"
#ifdef FULCRUM_WITH_NCCL
#include "comm/nccl_communicator.hpp"
#endif

namespace fulcrum::engine {
namespace {

constexpr const char* kLaunchEnv = "FULCRUM_RANK_LAUNCH";  // "local_rank world_rank world_size HOST:PORT timeout_s"

std::vector<std::string> own_arguments() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> args;
  std::string arg;
  while (std::getline(in, arg, '\0')) args.push_back(arg);
  FULCRUM_CHECK(!args.empty(), "cannot read this process's arguments from /proc/self/cmdline");
  return args;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

// The GPU each local rank sees as its device 0: the i-th of CUDA_VISIBLE_DEVICES, or GPU i.
std::vector<std::string> local_gpus(int num_local) {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  std::vector<std::string> gpus;
  if (visible == nullptr) {
    for (int i = 0; i < num_local; ++i) gpus.push_back(std::to_string(i));
    return gpus;
  }
  gpus = split_list(visible);
  FULCRUM_CHECK(static_cast<int>(gpus.size()) >= num_local,
                "--device cuda: this node runs {} ranks but CUDA_VISIBLE_DEVICES='{}' lists {} GPUs", num_local,
                visible, gpus.size());
  gpus.resize(num_local);
  return gpus;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return "stopped";
}

// What the launcher holds of one rank process's stderr, read from a pipe as it comes.
struct RankOutput {
  int fd = -1;          // the pipe's read end (-1 once the child closed it)
  std::string pending;  // a line not yet complete
  std::string held;     // hold-back mode: everything; streaming: only the "fulcrum: error: " lines
};

constexpr const char* kErrorPrefix = "fulcrum: error: ";

// Reads what is there; streaming passes complete lines on at once, except the error lines, which the launcher
// keeps to say once itself.
void drain(RankOutput& out, bool stream) {
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(out.fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) {
      ::close(out.fd);
      out.fd = -1;
      if (!out.pending.empty()) out.pending += '\n';
    } else {
      out.pending.append(buffer, static_cast<size_t>(n));
    }
    if (!stream) {
      out.held += out.pending;
      out.pending.clear();
    }
    for (size_t eol; (eol = out.pending.find('\n')) != std::string::npos;) {
      const std::string line = out.pending.substr(0, eol + 1);
      out.pending.erase(0, eol + 1);
      if (line.starts_with(kErrorPrefix)) {
        out.held += line;
      } else {
        std::fputs(line.c_str(), stderr);
        std::fflush(stderr);
      }
    }
    if (out.fd < 0) return;
  }
}

// Waits up to `ms` for output of any rank and drains it.
void drain_all(std::vector<RankOutput>& outputs, bool stream, int ms) {
  std::vector<pollfd> fds;
  std::vector<size_t> which;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].fd < 0) continue;
    fds.push_back({outputs[i].fd, POLLIN, 0});
    which.push_back(i);
  }
  if (fds.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return;
  }
  if (::poll(fds.data(), fds.size(), ms) <= 0) return;
  for (size_t k = 0; k < fds.size(); ++k) {
    if (fds[k].revents != 0) drain(outputs[which[k]], stream);
  }
}

// SIGINT / SIGTERM sent to a launcher that forwards them (serve): noted here, passed on by the reaping loop.
volatile std::sig_atomic_t g_forward_signal = 0;
extern "C" void note_signal(int sig) { g_forward_signal = sig; }

// The child's own one-line error (its last "fulcrum: error: " line), without the prefix.
std::string error_line(const std::string& err) {
  const std::string prefix = "fulcrum: error: ";
  const size_t at = err.rfind(prefix);
  if (at == std::string::npos) return "";
  const size_t end = err.find('\n', at);
  return err.substr(at + prefix.size(), end == std::string::npos ? std::string::npos : end - at - prefix.size());
}

}  // namespace

bool runs_as_processes(const DistFlags& flags, const std::string& device, int world_size) {
  return flags.nnodes > 1 || flags.multi_process || (device == "cuda" && world_size > 1);
}

void validate_dist_flags(const DistFlags& flags, int world_size) {
  FULCRUM_CHECK(flags.nnodes >= 1, "--nnodes must be at least 1, got {}", flags.nnodes);
  FULCRUM_CHECK(flags.node_rank >= 0 && flags.node_rank < flags.nnodes, "--node-rank {} outside [0, --nnodes {})",
                flags.node_rank, flags.nnodes);
  FULCRUM_CHECK(world_size % flags.nnodes == 0, "the layout's {} ranks do not divide evenly over --nnodes {}",
                world_size, flags.nnodes);
  FULCRUM_CHECK(flags.nnodes == 1 || !flags.dist_init_addr.empty(),
                "--nnodes {} needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)", flags.nnodes);
  if (!flags.dist_init_addr.empty()) comm::parse_host_port(flags.dist_init_addr, "--dist-init-addr");
  FULCRUM_CHECK(flags.dist_timeout_s > 0, "--dist-timeout must be positive, got {}", flags.dist_timeout_s);
}

std::optional<LaunchedRank> launched_rank() {
  const char* text = std::getenv(kLaunchEnv);
  if (text == nullptr) return std::nullopt;
  LaunchedRank me;
  std::istringstream in(text);
  in >> me.local_rank >> me.world_rank >> me.world_size >> me.dist_init_addr >> me.timeout_s;
  FULCRUM_CHECK(!in.fail() && me.world_rank >= 0 && me.world_rank < me.world_size, "malformed {}='{}'", kLaunchEnv,
                text);
  return me;
}

void launch_rank_processes(const DistFlags& flags, int world_size, const std::string& device,
                           const LaunchOptions& options) {
  validate_dist_flags(flags, world_size);
  const int num_local = world_size / flags.nnodes;
  const int first_rank = flags.node_rank * num_local;
  const std::string address =
      flags.dist_init_addr.empty() ? fmt::format("127.0.0.1:{}", comm::pick_free_port()) : flags.dist_init_addr;
  const std::vector<std::string> gpus = device == "cuda" ? local_gpus(num_local) : std::vector<std::string>(num_local);
  const std::vector<std::string> args = own_arguments();
  std::fflush(nullptr);  // nothing buffered is written twice by the children
  if (options.forward_signals) {
    struct sigaction action {};
    action.sa_handler = note_signal;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGINT, &action, nullptr);
    ::sigaction(SIGTERM, &action, nullptr);
  }

  const pid_t launcher = ::getpid();
  std::map<pid_t, int> running;     // pid -> local rank
  std::vector<pid_t> pids;          // per local rank
  std::vector<RankOutput> outputs;  // per local rank
  struct Failure {
    std::string line;
    bool lost_a_peer = false;  // it only reports another rank's failure
  };
  std::vector<Failure> failures;  // in the order the launcher saw them
  size_t num_stopped = 0;
  auto stop_all = [&](int sig) {
    for (const auto& [pid, local] : running) ::kill(pid, sig);
  };
  for (int local = 0; local < num_local; ++local) {
    const std::string launch =
        fmt::format("{} {} {} {} {}", local, first_rank + local, world_size, address, flags.dist_timeout_s);
    std::vector<std::pair<std::string, std::string>> env{{kLaunchEnv, launch}};
    if (!gpus[local].empty()) env.emplace_back("CUDA_VISIBLE_DEVICES", gpus[local]);
    const comm::ExecImage image = comm::exec_image(args, env);
    int pipe_fds[2];
    FULCRUM_CHECK(::pipe2(pipe_fds, O_CLOEXEC) == 0, "cannot create a pipe for a rank's stderr: {}", std::strerror(errno));
    const pid_t pid = ::fork();
    if (pid == 0) comm::exec_self(image, launcher, pipe_fds[1]);
    ::close(pipe_fds[1]);
    ::fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
    outputs.push_back({pipe_fds[0]});
    pids.push_back(pid);
    if (pid < 0) {
      failures.push_back({fmt::format("cannot start local rank {}: fork failed: {}", local, std::strerror(errno))});
      num_stopped = running.size();
      stop_all(SIGTERM);
      break;
    }
    running[pid] = local;
  }
  // The rank that owns the front end (world rank 0, on node 0): its exit ends the launch.
  const int front_local = first_rank == 0 ? 0 : -1;
  // With options.survive_lost_ranks a lost rank other than world rank 0 is reported and the others go on. On a node
  // without the front end (another node, or one rank restarted to rejoin) the command fails only when none of its
  // ranks is left and none finished cleanly: then the first failure is the command's, said in one line.
  int num_finished = 0;  // local ranks that exited cleanly
  // Reap; the first failure stops the rest (SIGTERM, then SIGKILL after a grace period), except, with
  // survive_lost_ranks, a rank other than world rank 0: the others go on without it.
  auto kill_deadline = std::chrono::steady_clock::time_point::max();
  while (!running.empty()) {
    if (const int sig = g_forward_signal; sig != 0) {
      g_forward_signal = 0;
      if (front_local >= 0 && running.contains(pids[front_local])) {
        ::kill(pids[front_local], sig);
      } else {
        stop_all(sig);
        kill_deadline = std::min(kill_deadline, std::chrono::steady_clock::now() + std::chrono::seconds(5));  // ours
      }
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno != EINTR) break;
    if (pid <= 0) {
      if (std::chrono::steady_clock::now() > kill_deadline) {
        stop_all(SIGKILL);
        kill_deadline = std::chrono::steady_clock::time_point::max();
      }
      drain_all(outputs, options.stream_stderr, 20);
      continue;
    }
    const auto it = running.find(pid);
    if (it == running.end()) continue;
    const int local = it->second;
    running.erase(it);
    if (outputs[local].fd >= 0) drain(outputs[local], options.stream_stderr);
    const bool front_end_left = local == front_local;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      ++num_finished;
      if (front_end_left && options.survive_lost_ranks) {  // the others may wait for a rank that is gone
        stop_all(SIGTERM);
        kill_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      }
      continue;
    }
    const bool stopped_by_us = (!failures.empty() || kill_deadline != std::chrono::steady_clock::time_point::max()) &&
                               WIFSIGNALED(status) && (WTERMSIG(status) == SIGTERM || WTERMSIG(status) == SIGKILL);
    if (stopped_by_us) continue;
    const std::string own = error_line(outputs[local].held);
    const std::string exit = fmt::format("rank {} (pid {}) {}", first_rank + local, pid, describe_status(status));
    const bool node_goes_on = front_local >= 0 || !running.empty() || num_finished > 0;
    if (options.survive_lost_ranks && !front_end_left && first_rank + local != 0 && node_goes_on) {
      std::fputs(fmt::format("fulcrum: rank {} lost: {}\n", first_rank + local, own.empty() ? exit : own + " [" + exit + "]").c_str(),
                 stderr);
      std::fflush(stderr);
      continue;
    }
    failures.push_back({own.empty() ? exit : own + " [" + exit + "]",
                        own.find(comm::kPeerFailedPhrase) != std::string::npos});
    if (failures.size() == 1) {
      num_stopped = running.size();
      stop_all(SIGTERM);
      kill_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    }
  }
  // Success: pass on what the ranks said (warnings). Failure: one line, the cause's (a rank that failed on
  // its own rather than one that lost its peer), whichever the launcher happened to reap first.
  const auto any_open = [&] { return std::any_of(outputs.begin(), outputs.end(), [](const RankOutput& o) { return o.fd >= 0; }); };
  for (int i = 0; i < 100 && any_open(); ++i) drain_all(outputs, options.stream_stderr, 10);  // the last words
  for (RankOutput& out : outputs) {
    if (out.fd >= 0) ::close(out.fd);
    if (failures.empty() && !options.stream_stderr) std::fputs(out.held.c_str(), stderr);
  }
  if (failures.empty()) return;
  const auto cause = std::find_if(failures.begin(), failures.end(), [](const Failure& f) { return !f.lost_a_peer; });
  std::string line = (cause != failures.end() ? *cause : failures.front()).line;
  if (num_stopped > 0) line += fmt::format("; stopped the other {} local rank(s)", num_stopped);
  throw Error(line);
}

comm::DistInit LaunchedRank::dist_init() const {
  return {comm::parse_host_port(dist_init_addr, "--dist-init-addr"), world_size, world_rank,
          std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000))};
}

InProcessResult generate_as_rank(const LaunchedRank& me, const std::string& model_dir,
                                 const model::Qwen3MoeConfig& config, const ParallelLayout& layout,
                                 const InProcessRun& run, const std::vector<std::vector<int32_t>>& prompts) {
  try {
    FULCRUM_CHECK(layout.world_size() == me.world_size, "the layout has {} ranks, the launcher started {}",
                  layout.world_size(), me.world_size);
    InProcessResult result = prepare_generate(config, layout, run);
    std::shared_ptr<comm::PeerMesh> mesh = comm::PeerMesh::connect(me.dist_init());
    std::unique_ptr<comm::Communicator> world;
    if (run.device == "cuda") {
#ifdef FULCRUM_WITH_NCCL
      world = comm::NcclCommunicator::create_world(mesh);  // this process's GPU is its device 0
#else
      throw Error("--device cuda with several ranks needs a build with NCCL (FULCRUM_ENABLE_CUDA and NCCL found)");
#endif
    } else {
      world = std::make_unique<comm::TcpCommunicator>(mesh);
    }
    generate_on_rank(me.world_rank, *world, model_dir, config, layout, run, prompts, result);
    return result;
  } catch (const std::exception& e) {
    throw Error(fmt::format("rank {}: {}", me.world_rank, e.what()));
  }
}

}  // namespace fulcrum::engine
