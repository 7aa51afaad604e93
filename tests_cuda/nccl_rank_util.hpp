#pragma once
// Rank processes for the NCCL tests on 2 GPUs: a test re-executes this binary once per rank with one
// NcclRank.* test and FULCRUM_NCCL_TEST="rank size port"; that child joins the world over a PeerMesh.
#include <gtest/gtest.h>

#include <cuda_runtime.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "comm/nccl_communicator.hpp"
#include "comm/tcp_socket.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {

// The `fulcrum generate` command the 2-GPU CLI tests extend with their layouts: three prompts on the golden
// tiny model, whose CPU one-rank tokens every GPU layout must print.
inline std::string tiny_generate_command() {
  return "generate --model " + golden_model_dir("qwen3moe-tiny-128e") +
         " --max-new-tokens 6 --prompt-tokens '3 17 250 9 41' --prompt-tokens '200' --prompt-tokens '0 8 99'";
}

struct RankEnv {
  int rank = 0;
  int size = 0;
  int port = 0;
};

inline std::optional<RankEnv> rank_env() {
  const char* text = std::getenv("FULCRUM_NCCL_TEST");
  if (text == nullptr) return std::nullopt;
  RankEnv e;
  std::istringstream(text) >> e.rank >> e.size >> e.port;
  return e;
}

// Runs `child_test` of this binary as `n` rank processes; returns their exit statuses (-1: killed).
inline std::vector<int> run_rank_processes(int n, const std::string& child_test) {
  using namespace std::chrono_literals;
  const int port = comm::pick_free_port();
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("FULCRUM_NCCL_TEST", fmt::format("{} {} {}", r, n, port).c_str(), 1);
      ::setenv("NCCL_NVLS_ENABLE", "0", 1);
      const std::string filter = "--gtest_filter=" + child_test;
      ::execl("/proc/self/exe", "fulcrum_cuda_tests", filter.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<int> statuses(n, -1);
  const auto deadline = std::chrono::steady_clock::now() + 300s;
  for (int r = 0; r < n; ++r) {
    int status = 0;
    while (::waitpid(pids[r], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) ::kill(pids[r], SIGKILL);
      std::this_thread::sleep_for(10ms);
    }
    statuses[r] = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  return statuses;
}

inline std::unique_ptr<comm::NcclCommunicator> join_world(const RankEnv& e) {
  FULCRUM_CUDA_CHECK(cudaSetDevice(e.rank % backend::CudaBackend::device_count()));
  auto mesh = comm::PeerMesh::connect({{"127.0.0.1", e.port}, e.size, e.rank, std::chrono::seconds(60)});
  return comm::NcclCommunicator::create_world(mesh);
}

}  // namespace fulcrum::test

#define FULCRUM_RANK_ONLY(env)                                      \
  const std::optional<RankEnv> env = rank_env();                    \
  if (!env) GTEST_SKIP() << "runs as a rank process of another test"

#define FULCRUM_NEEDS_GPUS(n)                                                  \
  if (backend::CudaBackend::device_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs"
