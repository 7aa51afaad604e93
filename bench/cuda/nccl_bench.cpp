// fulcrum_nccl_bench: NCCL figures between 2 GPUs, its ranks as processes (this binary re-executed once per
// rank, comm/local_ranks.hpp). Figures only, no threshold: rank 0 prints them and, with --json PATH, writes
// them with the command, --git-commit and the GPU's name (cudaGetDeviceProperties). In this order:
//   p2p             NcclCommunicator::all_to_all_v_device (1, 16, 256 MiB; rank 0 -> 1 and both directions at
//                   once, 20 calls after a warm-up) and the host-span all_to_all_v (both directions, 5 calls)
//   slot migration  a layer of Qwen3-30B-A3B-sized fp32 slots (hidden 2048, moe_intermediate 768) moved by
//                   comm::NcclSlotCopyExecutor, 20 layers after a warm-up: "transfer" is begin_layer .. wait
//                   on rank 0, "layer" adds the commits and end_layer; against one ncclSend/ncclRecv of the
//                   same bytes (exchange_device); 16 slots rank 0 -> 1, then 8 each way at once
//   row exchange    both token dispatchers (allgather, alltoall) with host-staged rows against device rows
//                   (tests_cuda/row_exchange_workload.hpp) at a 30B-A3B-like shape: 4096 tokens per rank x
//                   top-8 over 128 experts, hidden 2048, fp32; dispatch + stand-in expert + combine, best of 3
// Correctness is tested in tests_cuda (nccl_communicator_test, nccl_slot_migration_test,
// nccl_row_exchange_test); the row exchange here also refuses to report two paths whose results differ.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "comm/local_ranks.hpp"
#include "comm/nccl_communicator.hpp"
#include "gpu/moe/nccl_slot_copy_executor.hpp"
#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "row_exchange_workload.hpp"

namespace fulcrum::bench {
namespace {

using backend::DeviceBuffer;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string json_path;
  std::string git_commit = "unknown";
  std::string command;
};

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Where rank 0 leaves its figures for the launcher, which moves them to --json once both ranks succeeded.
std::string rank0_json_path(const Options& opt) { return opt.json_path + ".rank0"; }

json p2p(comm::NcclCommunicator& world) {
  const int rank = world.rank();
  const int peer = 1 - rank;
  json out = json::array();
  for (const int64_t bytes : {int64_t{1} << 20, int64_t{16} << 20, int64_t{256} << 20}) {
    const DeviceBuffer send(static_cast<size_t>(bytes)), recv(static_cast<size_t>(bytes));
    for (const bool both : {false, true}) {
      std::vector<int64_t> send_counts(2, 0), recv_counts(2, 0);
      if (both || rank == 0) send_counts[peer] = bytes;
      if (both || rank == 1) recv_counts[peer] = bytes;
      const auto step = [&] { world.all_to_all_v_device(send.as<std::byte>(), send_counts, recv.as<std::byte>(), recv_counts); };
      step();  // warm-up (connections)
      world.barrier();
      const int iterations = 20;
      const auto start = Clock::now();
      for (int i = 0; i < iterations; ++i) step();
      const double seconds = seconds_since(start) / iterations;
      if (rank == 0) {
        std::printf("nccl all_to_all_v_device %s %8.1f MiB: %.3f ms, %.1f GB/s per direction\n",
                    both ? "both directions" : "rank 0 -> 1    ", bytes / 1048576.0, seconds * 1e3, bytes / seconds / 1e9);
      }
      out.push_back({{"call", "all_to_all_v_device"}, {"direction", both ? "both" : "rank0_to_rank1"},
                     {"bytes_per_direction", bytes}, {"ms", seconds * 1e3}, {"gb_per_s", bytes / seconds / 1e9}});
    }
    // The host-span path (upload, NCCL, download), for comparison.
    std::vector<std::byte> host_send(static_cast<size_t>(bytes)), host_recv(static_cast<size_t>(bytes));
    std::vector<int64_t> counts(2, 0);
    counts[peer] = bytes;
    world.all_to_all_v(host_send, counts, host_recv, counts);
    const int iterations = 5;
    const auto start = Clock::now();
    for (int i = 0; i < iterations; ++i) world.all_to_all_v(host_send, counts, host_recv, counts);
    const double seconds = seconds_since(start) / iterations;
    if (rank == 0) {
      std::printf("nccl all_to_all_v (host spans) both directions %8.1f MiB: %.3f ms, %.1f GB/s per direction\n",
                  bytes / 1048576.0, seconds * 1e3, bytes / seconds / 1e9);
    }
    out.push_back({{"call", "all_to_all_v_host_spans"}, {"direction", "both"}, {"bytes_per_direction", bytes},
                   {"ms", seconds * 1e3}, {"gb_per_s", bytes / seconds / 1e9}});
  }
  std::fflush(stdout);
  return out;
}

json slot_migration(backend::CudaBackend& cuda, comm::NcclCommunicator& world) {
  const int rank = world.rank();
  const int peer = 1 - rank;
  const int num_slots = 16;
  model::ExpertSlotView view;
  view.num_slots = num_slots;
  view.gate_up = cuda.zeros({num_slots, 2 * 768, 2048});
  view.down = cuda.zeros({num_slots, 2048, 768});
  const int64_t per_slot = eplb_runtime::slot_bytes(view);
  const DeviceBuffer raw_send(static_cast<size_t>(num_slots * per_slot)), raw_recv(static_cast<size_t>(num_slots * per_slot));
  comm::NcclSlotCopyExecutor executor(cuda, world);
  const int iterations = 20;
  json out = json::array();
  for (const bool both : {false, true}) {
    // One direction: all 16 slots 0 -> 1; both: 8 slots each way.
    const int moved = both ? num_slots / 2 : num_slots;
    const bool sends = both || rank == 0;
    const bool recvs = both || rank == 1;
    const int64_t bytes = moved * per_slot;
    double transfer_s = 0;
    const auto layer = [&] {
      const auto start = Clock::now();
      executor.begin_layer(view, recvs ? moved : 0);
      for (int s = 0; s < moved && sends; ++s) executor.send(view, s, peer);
      for (int s = 0; s < moved && recvs; ++s) executor.recv(view, s, peer);
      executor.wait();
      transfer_s += seconds_since(start);
      for (int s = 0; s < moved && recvs; ++s) executor.commit_slot(view, s, num_slots - 1 - s);
      executor.end_layer();
    };
    std::vector<comm::NcclCommunicator::DeviceSend> raw_sends;
    std::vector<comm::NcclCommunicator::DeviceRecv> raw_recvs;
    if (sends) raw_sends.push_back({raw_send.as<std::byte>(), bytes, peer});
    if (recvs) raw_recvs.push_back({raw_recv.as<std::byte>(), bytes, peer});
    const auto raw = [&] { world.exchange_device(raw_sends, raw_recvs); };

    const auto time = [&](const auto& step) {
      step();  // warm-up: connections, staging
      world.barrier();
      transfer_s = 0;
      const auto start = Clock::now();
      for (int i = 0; i < iterations; ++i) step();
      world.barrier();
      return seconds_since(start) / iterations;
    };
    const double raw_s = time(raw);
    const double layer_s = time(layer);
    const double executor_transfer_s = transfer_s / iterations;
    if (rank == 0) {
      const char* dir = both ? "both directions" : "rank 0 -> 1    ";
      std::printf("slot migration %s: %d slots x %.1f MiB = %.1f MiB per direction\n", dir, moved,
                  per_slot / 1048576.0, bytes / 1048576.0);
      std::printf("  raw ncclSend/ncclRecv       %7.3f ms  %6.1f GB/s\n", raw_s * 1e3, bytes / raw_s / 1e9);
      std::printf("  executor transfer (..wait)  %7.3f ms  %6.1f GB/s  %.1f%% of raw\n", executor_transfer_s * 1e3,
                  bytes / executor_transfer_s / 1e9, 100 * raw_s / executor_transfer_s);
      std::printf("  executor layer (..commits)  %7.3f ms  %6.1f GB/s  %.1f%% of raw\n", layer_s * 1e3,
                  bytes / layer_s / 1e9, 100 * raw_s / layer_s);
      std::fflush(stdout);
    }
    out.push_back({{"direction", both ? "both" : "rank0_to_rank1"}, {"slots_per_direction", moved},
                   {"slot_bytes", per_slot}, {"bytes_per_direction", bytes}, {"raw_ms", raw_s * 1e3},
                   {"raw_gb_per_s", bytes / raw_s / 1e9}, {"executor_transfer_ms", executor_transfer_s * 1e3},
                   {"executor_transfer_gb_per_s", bytes / executor_transfer_s / 1e9},
                   {"executor_transfer_fraction_of_raw", raw_s / executor_transfer_s}, {"executor_layer_ms", layer_s * 1e3},
                   {"executor_layer_gb_per_s", bytes / layer_s / 1e9}, {"executor_layer_fraction_of_raw", raw_s / layer_s}});
  }
  return out;
}

json row_exchange(backend::CudaBackend& cuda, comm::NcclCommunicator& world) {
  const test::RowExchangeShape shape{4096, 8, 2048, 128, 1};
  const int repetitions = 3;
  const test::RowExchangeInputs in = test::row_exchange_inputs(cuda, world.rank(), shape);
  json out = json::array();
  for (const std::string name : {"allgather", "alltoall"}) {
    const test::BothPaths paths = test::run_both_paths(name, world, cuda, in, shape, repetitions);
    FULCRUM_CHECK(paths.device_path == "device", "{}: the device dispatcher's rows took the '{}' path", name,
                  paths.device_path);
    FULCRUM_CHECK(paths.host.rows == paths.device.rows && paths.host.combined == paths.device.combined,
                  "{}: the device path's results differ from the host-staged path's (nccl_row_exchange_test)", name);
    const double host_s = paths.host.seconds, device_s = paths.device.seconds;
    if (world.rank() == 0) {
      std::printf("%-9s %lld tokens/rank x top-%d, hidden %d, M=%d: host-staged %8.3f ms, device %7.3f ms (%.1fx)\n",
                  name.c_str(), static_cast<long long>(shape.tokens), shape.top_k, shape.hidden, shape.ranks_per_ep_rank,
                  host_s * 1e3, device_s * 1e3, host_s / device_s);
      std::fflush(stdout);
    }
    out.push_back({{"dispatcher", name}, {"tokens_per_rank", shape.tokens}, {"top_k", shape.top_k},
                   {"hidden", shape.hidden}, {"num_experts", shape.num_experts},
                   {"ranks_per_ep_rank", shape.ranks_per_ep_rank}, {"repetitions", repetitions},
                   {"host_staged_ms", host_s * 1e3}, {"device_ms", device_s * 1e3}, {"speedup", host_s / device_s}});
  }
  return out;
}

json machine(int device) {
  cudaDeviceProp prop{};
  FULCRUM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int driver = 0, runtime = 0, nccl = 0;
  FULCRUM_CUDA_CHECK(cudaDriverGetVersion(&driver));
  FULCRUM_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  FULCRUM_CHECK(ncclGetVersion(&nccl) == ncclSuccess, "ncclGetVersion failed");
  return {{"gpu", prop.name}, {"gpus_visible", backend::CudaBackend::device_count()}, {"cuda_driver", driver},
          {"cuda_runtime", runtime}, {"nccl", nccl}};
}

// One rank process: every part in order on one world; rank 0 leaves the JSON for the launcher.
void run_rank(const comm::LocalRank& me, const Options& opt) {
  const auto world = comm::join_local_world(me);
  backend::CudaBackend cuda(me.rank % backend::CudaBackend::device_count());  // the device join_local_world chose
  json doc{{"command", opt.command}, {"git_commit", opt.git_commit}};
  if (me.rank == 0) doc["machine"] = machine(me.rank % backend::CudaBackend::device_count());
  doc["p2p"] = p2p(*world);
  doc["slot_migration"] = slot_migration(cuda, *world);
  doc["row_exchange"] = row_exchange(cuda, *world);
  world->barrier();  // both ranks measured everything
  if (me.rank == 0 && !opt.json_path.empty()) write_file_atomically(rank0_json_path(opt), doc.dump(2) + "\n");
}

// The command the user ran: starts the 2 rank processes and, once both succeeded, puts the JSON in place.
void launch(const Options& opt, const std::vector<std::string>& argv) {
  namespace fs = std::filesystem;
  if (!opt.json_path.empty()) {
    const fs::path folder = fs::absolute(opt.json_path).parent_path();
    FULCRUM_CHECK(fs::is_directory(folder), "--json {}: folder {} does not exist", opt.json_path, folder.string());
  }
  const int num_devices = backend::CudaBackend::device_count();
  FULCRUM_CHECK(num_devices >= 2, "needs 2 GPUs, this process sees {}", num_devices);
  const std::vector<int> statuses = comm::run_local_rank_processes(2, argv, std::chrono::seconds(600));
  if (statuses != std::vector<int>{0, 0}) {
    std::error_code ignored;
    if (!opt.json_path.empty()) fs::remove(rank0_json_path(opt), ignored);
    throw Error(fmt::format("rank processes exited with {} and {} (-1: killed); see their errors above", statuses[0],
                            statuses[1]));
  }
  if (!opt.json_path.empty()) {
    std::error_code ec;
    fs::rename(rank0_json_path(opt), opt.json_path, ec);
    FULCRUM_CHECK(!ec, "--json {}: cannot move rank 0's figures into place: {}", opt.json_path, ec.message());
    std::printf("wrote %s\n", opt.json_path.c_str());
  }
}

}  // namespace
}  // namespace fulcrum::bench

int main(int argc, char** argv) {
  fulcrum::bench::Options opt;
  CLI::App app{"NCCL benchmark between 2 GPUs (P2P, slot migration, MoE row exchange)"};
  app.add_option("--json", opt.json_path, "write the figures as JSON here");
  app.add_option("--git-commit", opt.git_commit, "recorded in the JSON");
  CLI11_PARSE(app, argc, argv);
  std::vector<std::string> args(argv, argv + argc);
  for (const std::string& a : args) opt.command += (opt.command.empty() ? "" : " ") + a;
  std::optional<fulcrum::comm::LocalRank> me;
  try {
    me = fulcrum::comm::local_rank();
    if (me) fulcrum::bench::run_rank(*me, opt);
    else fulcrum::bench::launch(opt, args);
    return 0;
  } catch (const std::exception& e) {
    const std::string who = me ? fmt::format(" rank {}", me->rank) : "";
    std::fprintf(stderr, "fulcrum_nccl_bench%s: error: %s\n", who.c_str(), e.what());
    return 1;
  }
}
