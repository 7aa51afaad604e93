// Slot migration GPU to GPU (comm::NcclSlotCopyExecutor) on 2 GPUs, ranks as processes (nccl_rank_util.hpp):
// migrated slots hold exactly the source bytes, the same as the host-path executor (BackendSlotCopyExecutor,
// the reference) on the same plan; `fulcrum generate --device cuda --tp 2 --ep 2 --enable-eplb` prints the CPU
// one-rank tokens with slots migrated by this executor. (Its bandwidth against raw ncclSend/ncclRecv:
// fulcrum_nccl_bench.)
#include <gtest/gtest.h>

#include <cstdio>
#include <regex>

#include "gpu/moe/nccl_slot_copy_executor.hpp"
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

// One layer's plan, the same on both of 2 ranks (each sends to and receives from the other).
struct Plan {
  int num_staging = 0;
  std::vector<std::pair<int, int>> local;    // (slot, staging entry)
  std::vector<int> sends;                    // slots, in order
  std::vector<int> recvs;                    // staging entries, in order (the peer's sends)
  std::vector<std::pair<int, int>> commits;  // (staging entry, slot)
};

void run_plan(eplb_runtime::SlotCopyExecutor& executor, const model::ExpertSlotView& view, int peer, const Plan& plan) {
  executor.begin_layer(view, plan.num_staging);
  for (const auto& [slot, entry] : plan.local) executor.copy_local(view, slot, entry);
  for (const int slot : plan.sends) executor.send(view, slot, peer);
  for (const int entry : plan.recvs) executor.recv(view, entry, peer);
  executor.wait();
  for (const auto& [entry, slot] : plan.commits) executor.commit_slot(view, entry, slot);
  executor.end_layer();
}

// The plan on host copies of both ranks' slots (each slot: gate_up values then down values).
using HostSlots = std::vector<std::vector<float>>;
void simulate(HostSlots& mine, const HostSlots& theirs, const Plan& plan) {
  HostSlots staging(plan.num_staging);
  for (const auto& [slot, entry] : plan.local) staging[entry] = mine[slot];
  for (size_t i = 0; i < plan.recvs.size(); ++i) staging[plan.recvs[i]] = theirs[plan.sends[i]];
  for (const auto& [entry, slot] : plan.commits) mine[slot] = staging[entry];
}

HostSlots host_slots(const SlotLayer& layer) {
  HostSlots slots;
  for (size_t s = 0; s < layer.gate_up.size(); ++s) {
    slots.push_back(layer.gate_up[s]);
    slots.back().insert(slots.back().end(), layer.down[s].begin(), layer.down[s].end());
  }
  return slots;
}

std::vector<float> device_slot(backend::CudaBackend& cuda, const model::ExpertSlotView& view, int s) {
  std::vector<float> values = cuda.download(view.gate_up.index(s));
  const std::vector<float> down = cuda.download(view.down.index(s));
  values.insert(values.end(), down.begin(), down.end());
  return values;
}

TEST(NcclRank, SlotMigrationMovesExactBytes) {
  FULCRUM_RANK_ONLY(env);
  auto world = comm::join_local_world(*env);
  backend::CudaBackend cuda(env->rank);
  const int peer = 1 - env->rank;
  const int64_t h = 96;
  const int64_t w = 40;
  SlotLayer mine = make_layer(cuda, env->rank, 4, h, w);
  SlotLayer reference = make_layer(cuda, env->rank, 4, h, w);
  HostSlots expected_mine = host_slots(mine);
  HostSlots expected_theirs = host_slots(make_layer(cuda, peer, 4, h, w));  // the peer's values

  // A: the sent slots are not consecutive, the staging entries are; B: the other way round, received out of
  // order; C: consecutive on both sides (one op per tensor).
  const std::vector<Plan> plans{{3, {{0, 0}}, {1, 3}, {1, 2}, {{0, 2}, {1, 0}, {2, 1}}},
                                {3, {{1, 1}}, {2, 3}, {2, 0}, {{0, 3}, {1, 0}, {2, 2}}},
                                {3, {}, {0, 1, 2}, {0, 1, 2}, {{0, 1}, {1, 2}, {2, 3}}}};
  comm::NcclSlotCopyExecutor executor(cuda, *world);
  eplb_runtime::BackendSlotCopyExecutor host_path(cuda, *world);
  for (size_t p = 0; p < plans.size(); ++p) {
    run_plan(executor, mine.view, peer, plans[p]);
    run_plan(host_path, reference.view, peer, plans[p]);
    const HostSlots theirs_before = expected_theirs;
    simulate(expected_theirs, expected_mine, plans[p]);
    simulate(expected_mine, theirs_before, plans[p]);
    for (int s = 0; s < 4; ++s) {
      const std::vector<float> got = device_slot(cuda, mine.view, s);
      EXPECT_EQ(got, expected_mine[s]) << "plan " << p << " slot " << s;
      EXPECT_EQ(got, device_slot(cuda, reference.view, s)) << "plan " << p << " slot " << s << " vs host path";
    }
  }
  EXPECT_EQ(executor.peak_staging_bytes(), 3 * eplb_runtime::slot_bytes(mine.view));

  // A send to this rank itself is a one-line error, before anything reaches NCCL (the world stays usable).
  executor.begin_layer(mine.view, 0);
  try {
    executor.send(mine.view, 0, env->rank);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("slot migration: send to rank"), std::string::npos) << e.what();
  }
  executor.wait();
  executor.end_layer();
  world->barrier();
}

TEST(NcclSlotMigration, ExactBytesOnTwoGpus) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.SlotMigrationMovesExactBytes"), (std::vector<int>{0, 0}));
}

// Both GPU ranks migrate slots between them (rank 0 receives some) and the tokens stay the CPU one-rank ones.
TEST(CudaGenerate, EplbMigratesSlotsGpuToGpuAndKeepsTheCpuTokens) {
  FULCRUM_NEEDS_GPUS(2);
  TempDir dir("cuda_eplb_migration");
  const std::string base = tiny_generate_command();
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
