#pragma once
// `fulcrum bench moe`: the bf16 GPU MoE layer (src/gpu/moe/moe_layer.hpp) at the Qwen3-30B-A3B and
// Qwen3-235B-A22B MoE shapes with random weights, routing drawn from one layer of a real load matrix or
// uniform. One GPU: every slot on the GPU, EP ranks simulated (single_gpu_bench.cpp). Several GPUs: one
// process per GPU, real expert parallelism over NCCL, plus live migration against raw NCCL P2P and the
// forward-pass inflation while a migration is in flight (ep_bench.cpp). One GPU with --torch-peer: PyTorch's
// grouped_mm MoE on the uniform routing of the same run (bench/peer/torch_moe_peer.py, torch_peer.hpp).
// Results print as lines and go to a JSON file (command, machine, git commit, figures). This header needs no
// CUDA (the CLI parses the flags of a build without CUDA too, and says why it cannot run).
#include <cstdint>
#include <string>
#include <vector>

namespace fulcrum::comm {
class NcclCommunicator;
}
namespace fulcrum::engine {
struct LaunchedRank;
}

namespace fulcrum::bench_moe {

struct MoeBenchOptions {
  std::vector<std::string> models{"qwen3-30b-a3b", "qwen3-235b-a22b"};
  std::vector<int64_t> tokens{256, 1024, 4096, 16384};  // per forward (several GPUs: per rank)
  int reps = 20;
  int warmup = 3;
  int gpus = 1;
  int ep = 8;              // one GPU: simulated EP ranks (several GPUs: the GPUs)
  int redundant = 8;       // EPLB redundant slots
  int loads_layer = -1;    // -1: the layer least balanced over the EP ranks
  int passes = 20;         // several GPUs: forward passes per inflation figure
  int migration_max_ctas = 0;  // several GPUs: SM cap of the migration communicator (0: NCCL's choice)
  int layers_per_pass = 0;  // several GPUs: MoE layer forwards per pass; 0: the model's MoE layers (48 / 94)
  std::string loads;
  // One GPU: the PyTorch peer script run after the timings (bench/peer/torch_moe_peer.py); "auto": that script
  // when python3 here imports torch, "off": none (torch_peer.hpp resolve_torch_peer).
  std::string torch_peer = "auto";
  std::string json_path;
  std::string git_commit = "unknown";
  std::string command;
};

constexpr int kMoeBenchExperts = 128;  // both Qwen3 MoE shapes

struct ModelShape {
  std::string name;
  int hidden = 0;
  int intermediate = 0;
  int num_layers = 0;  // MoE layers of the model (a forward pass runs each once)
};
ModelShape model_shape(const std::string& name);  // qwen3-30b-a3b or qwen3-235b-a22b; else a one-line error

// Checks the options (one-line errors): known models, positive sizes, a readable load matrix of 128
// experts. The run functions below take validated options (the CLI validates first).
void validate(const MoeBenchOptions& opt);

// One-line error when this machine shows fewer than `gpus` CUDA devices (or none works).
void check_visible_gpus(int gpus);

// One GPU (device 0 of this process).
void run_single_gpu(const MoeBenchOptions& opt);

// One rank of a several-GPU run: `ep` carries the forward pass's collectives, `migration` (the same ranks)
// the slot migration. Rank 0 prints and writes the JSON.
void run_ep_rank(const MoeBenchOptions& opt, comm::NcclCommunicator& ep, comm::NcclCommunicator& migration);
// A rank process the launcher started (engine::launch_rank_processes): joins the world, makes both
// communicators and runs run_ep_rank.
void run_as_rank(const MoeBenchOptions& opt, const engine::LaunchedRank& me);

}  // namespace fulcrum::bench_moe
