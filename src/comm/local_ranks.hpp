#pragma once
// Rank processes on this host for a program that runs a whole world from one binary (the NCCL tests in
// tests_cuda, fulcrum_nccl_bench): it re-executes itself once per rank with the arguments it chooses and
// FULCRUM_LOCAL_RANK="rank size port" in the environment; each child joins the world's rendezvous at
// 127.0.0.1:port. The CLI has its own launcher (nodes, GPU pinning, error relaying): engine/multi_process_run.hpp.
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "comm/peer_mesh.hpp"

namespace fulcrum::comm {

struct LocalRank {
  int rank = 0;
  int size = 0;
  int port = 0;  // where world rank 0 serves the rendezvous, on 127.0.0.1
  DistInit dist_init(std::chrono::milliseconds timeout) const { return {{"127.0.0.1", port}, size, rank, timeout}; }
};

// This process's place when run_local_rank_processes started it; empty otherwise. Throws a one-line error
// on a malformed FULCRUM_LOCAL_RANK.
std::optional<LocalRank> local_rank();

// Starts `n` rank processes of this executable (/proc/self/exe with `argv`, argv[0] included) and waits for
// them; returns their exit statuses in rank order (-1: killed by a signal, also by this launcher when
// `timeout` passes). The children die with the launcher.
std::vector<int> run_local_rank_processes(int n, const std::vector<std::string>& argv, std::chrono::seconds timeout);

}  // namespace fulcrum::comm
