#pragma once
// Generation with each rank in its own process: one command starts one process per local rank (fork + exec
// of this executable with the same arguments and a hidden FULCRUM_RANK_LAUNCH environment variable); each
// joins the rendezvous at --dist-init-addr, builds its world communicator (NCCL for --device cuda, TCP for
// cpu) and runs the same per-rank body as the in-process path (generate_on_rank). Several nodes: the user
// starts one command per node with --nnodes / --node-rank / --dist-init-addr (SGLang's flags).
#include <optional>
#include <string>
#include <vector>

#include "comm/peer_mesh.hpp"
#include "engine/parallel_generate.hpp"

namespace fulcrum::engine {

struct DistFlags {
  int nnodes = 1;
  int node_rank = 0;
  std::string dist_init_addr;  // HOST:PORT where world rank 0 (node 0) serves the rendezvous
  bool multi_process = false;  // --device cpu: ranks as processes rather than threads
  double dist_timeout_s = 120;  // how long the rendezvous waits for every rank
};

// Whether this command's ranks run as processes: several nodes, --multi-process, or CUDA with several ranks.
bool runs_as_processes(const DistFlags& flags, const std::string& device, int world_size);
// One-line errors for flags that cannot work together (nodes that do not divide the world, a missing address).
void validate_dist_flags(const DistFlags& flags, int world_size);

// What a launched rank process is told by its launcher.
struct LaunchedRank {
  int local_rank = 0;
  int world_rank = 0;
  int world_size = 1;
  std::string dist_init_addr;
  double timeout_s = 120;
  // Where this rank joins its world (comm::PeerMesh::connect).
  comm::DistInit dist_init() const;
};
// Set in a process the launcher started; empty in the command the user ran.
std::optional<LaunchedRank> launched_rank();

// The launcher: starts this node's world_size / nnodes rank processes and waits for them. When one fails,
// the others are stopped (SIGTERM, then SIGKILL) and one line carries the first failing rank's own error
// and exit (the ranks' stderr is held back and passed on only on success); children die with the
// launcher (PR_SET_PDEATHSIG), so none is orphaned. With --device cuda, local rank i sees only the i-th
// visible GPU (CUDA_VISIBLE_DEVICES). NVLink multicast stays off (NCCL_NVLS_ENABLE=0) in every child.
// LaunchOptions change that for a server: its ranks' stderr is its log, passed on line by line as it comes
// (their "fulcrum: error: " lines excepted: the launcher's own line says the failure once), SIGINT/SIGTERM
// go to world rank 0 (it drains and stops the others), and with elastic EP a rank other than world rank 0
// that fails is reported ("fulcrum: rank R lost: ...") while the others go on, on every node (a node without
// the front end, or a command restarting one lost rank, fails only when every one of its ranks failed: then in
// one line, its first failing rank's, as without elastic EP).
struct LaunchOptions {
  bool stream_stderr = false;
  bool forward_signals = false;
  bool survive_lost_ranks = false;
};
void launch_rank_processes(const DistFlags& flags, int world_size, const std::string& device,
                           const LaunchOptions& options = {});

// A launched rank: joins the world and runs generate_on_rank. Only world rank 0's result is complete.
InProcessResult generate_as_rank(const LaunchedRank& me, const std::string& model_dir,
                                 const model::Qwen3MoeConfig& config, const ParallelLayout& layout,
                                 const InProcessRun& run, const std::vector<std::vector<int32_t>>& prompts);

}  // namespace fulcrum::engine
