// NCCL communicator on 2 GPUs, its ranks as processes (this binary re-executed with one NcclRank.* test,
// nccl_rank_util.hpp): every collective against its definition and bitwise against the in-process
// communicator, and a peer that dies aborts the survivor instead of hanging it (the device-pointer path's
// bandwidth: fulcrum_nccl_bench). Then `fulcrum generate --device cuda --tp 2 --ep 2` on 2 GPUs, as
// one command and as 2 nodes x 1 GPU, prints the CPU one-rank tokens.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>

#include "backend/cuda/cuda_backend.hpp"
#include "comm/in_process_communicator.hpp"
#include "comm/nccl_communicator.hpp"
#include "communicator_checks.hpp"
#include "eplb/error.hpp"
#include "model_test_util.hpp"
#include "nccl_rank_util.hpp"

namespace fulcrum::test {
namespace {

using namespace std::chrono_literals;

TEST(NcclRank, Collectives) {
  FULCRUM_RANK_ONLY(env);
  auto world = comm::join_local_world(*env);
  check_collectives(env->rank, env->size, *world);
  // Bitwise the in-process communicator's results on the same inputs (each rank runs that reference itself).
  std::vector<std::vector<std::byte>> expected;
  comm::run_in_process(env->size, [&](int r, comm::Communicator& c) {
    auto out = collective_outputs(r, env->size, c);
    if (r == env->rank) expected = std::move(out);
  });
  const auto got = collective_outputs(env->rank, env->size, *world);
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(got[i], expected[i]) << "collective #" << i;
  // Every rank holds bitwise the same all_reduce result.
  std::vector<std::byte> all(got[0].size() * env->size);
  world->all_gather(got[0], all);
  for (int r = 0; r < env->size; ++r) {
    EXPECT_TRUE(std::equal(got[0].begin(), got[0].end(), all.begin() + static_cast<std::ptrdiff_t>(r * got[0].size())));
  }
  // Split: singletons and the whole world again, reversed.
  auto alone = world->split(env->rank, 0);
  EXPECT_EQ(alone->size(), 1);
  auto reversed = world->split(7, -env->rank);
  EXPECT_EQ(reversed->rank(), env->size - 1 - env->rank);
  std::vector<float> x{static_cast<float>(env->rank + 1)};
  reversed->all_reduce_sum(x);
  EXPECT_EQ(x[0], static_cast<float>(env->size * (env->size + 1) / 2));
  alone->all_reduce_sum(x);
  check_collectives(reversed->rank(), env->size, *reversed);
}

TEST(NcclRank, APeerThatDiesAbortsTheSurvivor) {
  FULCRUM_RANK_ONLY(env);
  auto world = comm::join_local_world(*env);
  world->barrier();
  if (env->rank == 1) ::_exit(3);  // dies without a goodbye, while rank 0 is in an all_reduce
  std::vector<float> x(1 << 20, 1.0f);
  const auto start = std::chrono::steady_clock::now();
  try {
    world->all_reduce_sum(x);
    world->all_reduce_sum(x);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NCCL communicator aborted: rank 1"), std::string::npos) << e.what();
  }
  std::printf("survivor noticed the dead peer after %.3f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  std::fflush(nullptr);
  ::_exit(::testing::Test::HasFailure() ? 1 : 0);  // the aborted communicator is not torn down again
}

TEST(NcclCommunicator, CollectivesOnTwoGpus) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.Collectives"), (std::vector<int>{0, 0}));
}

TEST(NcclCommunicator, APeerThatDiesAbortsTheSurvivor) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.APeerThatDiesAbortsTheSurvivor"), (std::vector<int>{0, 3}));
}

TEST(CudaGenerate, TwoGpuRanksPrintTheCpuOneRankTokens) {
  FULCRUM_NEEDS_GPUS(2);
  TempDir dir("cuda_multi_gpu");
  const std::string base = tiny_generate_command();
  const CliRun cpu = run_cli(dir, base);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  const CliRun gpus = run_cli(dir, base + " --device cuda --tp 2 --ep 2");
  ASSERT_EQ(gpus.exit_code, 0) << gpus.err;
  EXPECT_EQ(tokens_of(gpus.out), tokens_of(cpu.out));
  EXPECT_NE(gpus.out.find("on cuda x 2 process ranks"), std::string::npos) << gpus.out;
  std::printf("one command, 2 GPUs:\n%s", gpus.out.c_str());

  // 2 nodes x 1 GPU on this host: each command sees one GPU.
  const auto [node0, node1] = run_cli_two_nodes(dir, base + " --device cuda --tp 2 --ep 2 --nnodes 2 --dist-init-addr 127.0.0.1:" +
                                                         std::to_string(comm::pick_free_port()),
                                                "CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1");
  EXPECT_EQ(node0.exit_code, 0) << node0.err;
  EXPECT_EQ(node1.exit_code, 0) << node1.err;
  EXPECT_EQ(tokens_of(node0.out), tokens_of(cpu.out));
  std::printf("2 nodes x 1 GPU, node 0:\n%s", node0.out.c_str());
}

}  // namespace
}  // namespace fulcrum::test
