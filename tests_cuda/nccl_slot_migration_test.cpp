// Slot migration GPU to GPU (comm::NcclSlotCopyExecutor) on 2 GPUs, ranks as processes (nccl_rank_util.hpp):
// migrated slots hold exactly the source bytes, the same as the host-path executor (BackendSlotCopyExecutor,
// the reference) on the same plan; a bandwidth report against raw ncclSend/ncclRecv of the same bytes
// (figures only, no threshold); `fulcrum generate --device cuda --tp 2 --ep 2 --enable-eplb` prints the CPU
// one-rank tokens with slots migrated by this executor.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <regex>

#include "comm/nccl_slot_copy_executor.hpp"
#include "cuda_test_util.hpp"
#include "eplb/error.hpp"
#include "model_test_util.hpp"
#include "nccl_rank_util.hpp"

namespace fulcrum::test {
namespace {

// A layer of `num_slots` slots on this rank (hidden h, expert width w), every value a function of
// (rank, slot, element) so a peer can compute what it should receive.
struct SlotLayer {
  model::ExpertSlotView view;
  std::vector<std::vector<float>> gate_up;  // per slot, host copies of the values uploaded
  std::vector<std::vector<float>> down;
};

SlotLayer make_layer(backend::CudaBackend& cuda, int rank, int num_slots, int64_t h, int64_t w) {
  SlotLayer layer;
  layer.view.num_slots = num_slots;
  layer.view.gate_up = cuda.zeros({num_slots, 2 * w, h});
  layer.view.down = cuda.zeros({num_slots, h, w});
  for (int s = 0; s < num_slots; ++s) {
    layer.gate_up.push_back(random_values(2 * w * h, static_cast<uint32_t>(1000 * rank + 2 * s)));
    layer.down.push_back(random_values(h * w, static_cast<uint32_t>(1000 * rank + 2 * s + 1)));
    cuda.upload(layer.view.gate_up.index(s), layer.gate_up.back());
    cuda.upload(layer.view.down.index(s), layer.down.back());
  }
  return layer;
}

// One layer's plan on each of 2 ranks: local copy of slot 0 into staging 0, slots 1 and 3 to the peer,
// the peer's slots 1 and 3 into staging 1 and 2; commits: staging 0 -> slot 2, 1 -> slot 0, 2 -> slot 1.
void run_plan(eplb_runtime::SlotCopyExecutor& executor, const model::ExpertSlotView& view, int peer) {
  executor.begin_layer(view, 3);
  executor.copy_local(view, 0, 0);
  executor.send(view, 1, peer);
  executor.send(view, 3, peer);
  executor.recv(view, 1, peer);
  executor.recv(view, 2, peer);
  executor.wait();
  executor.commit_slot(view, 0, 2);
  executor.commit_slot(view, 1, 0);
  executor.commit_slot(view, 2, 1);
  executor.end_layer();
}

TEST(NcclRank, SlotMigrationMovesExactBytes) {
  FULCRUM_RANK_ONLY(env);
  auto world = join_world(*env);
  backend::CudaBackend cuda(env->rank);
  const int peer = 1 - env->rank;
  const int64_t h = 96;
  const int64_t w = 40;
  SlotLayer mine = make_layer(cuda, env->rank, 4, h, w);
  const SlotLayer theirs = make_layer(cuda, peer, 4, h, w);  // the peer's values, to know what arrives
  SlotLayer reference = make_layer(cuda, env->rank, 4, h, w);

  comm::NcclSlotCopyExecutor executor(cuda, *world);
  run_plan(executor, mine.view, peer);
  eplb_runtime::BackendSlotCopyExecutor host_path(cuda, *world);
  run_plan(host_path, reference.view, peer);

  // slot -> (values of gate_up, values of down) expected after the plan.
  const std::vector<std::pair<const std::vector<float>*, const std::vector<float>*>> expected{
      {&theirs.gate_up[1], &theirs.down[1]}, {&theirs.gate_up[3], &theirs.down[3]},
      {&mine.gate_up[0], &mine.down[0]}, {&mine.gate_up[3], &mine.down[3]}};
  for (int s = 0; s < 4; ++s) {
    const std::vector<float> gate_up = cuda.download(mine.view.gate_up.index(s));
    const std::vector<float> down = cuda.download(mine.view.down.index(s));
    EXPECT_EQ(gate_up, *expected[s].first) << "slot " << s << " gate_up";
    EXPECT_EQ(down, *expected[s].second) << "slot " << s << " down";
    EXPECT_EQ(gate_up, cuda.download(reference.view.gate_up.index(s))) << "slot " << s << " vs host path";
    EXPECT_EQ(down, cuda.download(reference.view.down.index(s))) << "slot " << s << " vs host path";
  }
  EXPECT_EQ(executor.peak_staging_bytes(), 3 * eplb_runtime::slot_bytes(mine.view));

  // A send to this rank itself is a one-line error, before anything reaches NCCL (the world stays usable).
  executor.begin_layer(mine.view, 0);
  executor.send(mine.view, 0, env->rank);
  try {
    executor.wait();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exchange_device: peer"), std::string::npos) << e.what();
  }
  executor.end_layer();
  world->barrier();
}

// Figures only: a layer of Qwen3-30B-A3B-sized fp32 slots (hidden 2048, moe_intermediate 768) moved by the
// executor (begin_layer .. end_layer, commits included, and begin_layer .. wait, the transfer alone)
// against one ncclSend/ncclRecv of the same byte count, rank 0 -> 1 and both directions at once.
TEST(NcclRank, SlotMigrationBandwidth) {
  FULCRUM_RANK_ONLY(env);
  auto world = join_world(*env);
  backend::CudaBackend cuda(env->rank);
  const int peer = 1 - env->rank;
  const int num_slots = 16;
  model::ExpertSlotView view;
  view.num_slots = num_slots;
  view.gate_up = cuda.zeros({num_slots, 2 * 768, 2048});
  view.down = cuda.zeros({num_slots, 2048, 768});
  const int64_t per_slot = eplb_runtime::slot_bytes(view);
  std::byte* raw_send = nullptr;
  std::byte* raw_recv = nullptr;
  FULCRUM_CUDA_CHECK(cudaMalloc(&raw_send, num_slots * per_slot));
  FULCRUM_CUDA_CHECK(cudaMalloc(&raw_recv, num_slots * per_slot));
  comm::NcclSlotCopyExecutor executor(cuda, *world);
  const int iterations = 20;

  for (const bool both : {false, true}) {
    // One direction: all 16 slots 0 -> 1; both: 8 slots each way.
    const int moved = both ? num_slots / 2 : num_slots;
    const bool sends = both || env->rank == 0;
    const bool recvs = both || env->rank == 1;
    const int64_t bytes = moved * per_slot;
    double transfer_s = 0;
    const auto layer = [&] {
      const auto start = std::chrono::steady_clock::now();
      executor.begin_layer(view, recvs ? moved : 0);
      for (int s = 0; s < moved && sends; ++s) executor.send(view, s, peer);
      for (int s = 0; s < moved && recvs; ++s) executor.recv(view, s, peer);
      executor.wait();
      transfer_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      for (int s = 0; s < moved && recvs; ++s) executor.commit_slot(view, s, num_slots - 1 - s);
      executor.end_layer();
    };
    std::vector<comm::NcclCommunicator::DeviceSend> raw_sends;
    std::vector<comm::NcclCommunicator::DeviceRecv> raw_recvs;
    if (sends) raw_sends.push_back({raw_send, bytes, peer});
    if (recvs) raw_recvs.push_back({raw_recv, bytes, peer});
    const auto raw = [&] { world->exchange_device(raw_sends, raw_recvs); };

    const auto time = [&](const auto& step) {
      step();  // warm-up: connections, staging
      world->barrier();
      transfer_s = 0;
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < iterations; ++i) step();
      world->barrier();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iterations;
    };
    const double raw_s = time(raw);
    const double layer_s = time(layer);
    const double executor_transfer_s = transfer_s / iterations;
    if (env->rank == 0) {
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
  }
  FULCRUM_CUDA_CHECK(cudaFree(raw_send));
  FULCRUM_CUDA_CHECK(cudaFree(raw_recv));
}

TEST(NcclSlotMigration, ExactBytesOnTwoGpus) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.SlotMigrationMovesExactBytes"), (std::vector<int>{0, 0}));
}

TEST(NcclSlotMigration, Bandwidth) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.SlotMigrationBandwidth"), (std::vector<int>{0, 0}));
}

// Both GPU ranks migrate slots between them (rank 0 receives some) and the tokens stay the CPU one-rank ones.
TEST(CudaGenerate, EplbMigratesSlotsGpuToGpuAndKeepsTheCpuTokens) {
  FULCRUM_NEEDS_GPUS(2);
  TempDir dir("cuda_eplb_migration");
  const std::string base = "generate --model " + golden_model_dir("qwen3moe-tiny-128e") +
                           " --max-new-tokens 6 --prompt-tokens '3 17 250 9 41' --prompt-tokens '200' "
                           "--prompt-tokens '0 8 99'";
  const CliRun cpu = run_cli(dir, base);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  const CliRun gpus = run_cli(dir, base + " --device cuda --tp 2 --ep 2 --enable-eplb --ep-num-redundant-experts 2 "
                                          "--eplb-rebalance-num-iterations 2");
  ASSERT_EQ(gpus.exit_code, 0) << gpus.err;
  std::printf("%s", gpus.out.c_str());
  EXPECT_EQ(tokens_of(gpus.out), tokens_of(cpu.out));
  EXPECT_NE(gpus.out.find("# eplb: slot migration: device to device, NCCL P2P"), std::string::npos) << gpus.out;
  std::smatch received;
  ASSERT_TRUE(std::regex_search(gpus.out, received, std::regex("(\\d+) slots received over the network by rank 0")))
      << gpus.out;
  EXPECT_GT(std::stoi(received[1]), 0) << gpus.out;
}

}  // namespace
}  // namespace fulcrum::test
