#pragma once
// Rank processes for the NCCL tests on 2 GPUs: a test re-executes this binary once per rank with one
// NcclRank.* test (comm/local_ranks.hpp); that child joins the world with comm::join_local_world.
#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.hpp"
#include "comm/local_ranks.hpp"
#include "comm/nccl_communicator.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {

// Runs `child_test` of this binary as `n` rank processes; returns their exit statuses (-1: killed).
inline std::vector<int> run_rank_processes(int n, const std::string& child_test) {
  return comm::run_local_rank_processes(n, {"fulcrum_cuda_tests", "--gtest_filter=" + child_test}, std::chrono::seconds(300));
}

}  // namespace fulcrum::test

#define FULCRUM_RANK_ONLY(env)                                      \
  const std::optional<comm::LocalRank> env = comm::local_rank();    \
  if (!env) GTEST_SKIP() << "runs as a rank process of another test"

#define FULCRUM_NEEDS_GPUS(n)                                                  \
  if (backend::CudaBackend::device_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs"
