// The MoE token exchange's rows GPU to GPU (engine::RowExchange, comm::NcclRowExchange) on 2 GPU rank
// processes: both dispatchers (allgather, alltoall) run once with the host-staged rows and once with the
// device rows on the same inputs (row_exchange_workload.hpp); dispatched rows and combined outputs must be
// bitwise equal, and equal to their definition. (Their timing at a 30B-A3B-like shape: fulcrum_nccl_bench.)
// Then `fulcrum generate --device cuda --tp 2 --ep 2` with both backends, with and without EPLB and
// redundant experts, prints the CPU one-rank tokens and says the rows took the device path.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "model_test_util.hpp"
#include "nccl_rank_util.hpp"
#include "row_exchange_workload.hpp"

namespace fulcrum::test {
namespace {

void compare_paths(const comm::LocalRank& env, const RowExchangeShape& shape) {
  auto world = comm::join_local_world(env);
  backend::CudaBackend backend(env.rank % backend::CudaBackend::device_count());  // the device join_local_world chose
  const RowExchangeInputs in = row_exchange_inputs(backend, env.rank, shape);
  for (const std::string name : {"allgather", "alltoall"}) {
    const BothPaths paths = run_both_paths(name, *world, backend, in, shape, 1);
    const ExchangeResult& host = paths.host;
    const ExchangeResult& device = paths.device;
    EXPECT_EQ(paths.device_path, "device");
    EXPECT_EQ(paths.device_calls, 2);
    ASSERT_EQ(host.rows.size(), device.rows.size()) << name;
    EXPECT_TRUE(host.rows == device.rows) << name << ": dispatched rows differ";
    ASSERT_EQ(host.combined.size(), device.combined.size()) << name;
    EXPECT_TRUE(host.combined == device.combined) << name << ": combined outputs differ";
    // Definition: every entry comes back as 2 * its token's row from each of its M ranks.
    ASSERT_EQ(device.combined.size(), in.token.size() * static_cast<size_t>(shape.hidden)) << name;
    for (size_t i = 0; i < in.token.size(); ++i) {
      for (int h = 0; h < shape.hidden; h += 97) {
        const float v = in.host_x[static_cast<size_t>(in.token[i]) * shape.hidden + h] * 2.0f;
        ASSERT_EQ(device.combined[i * shape.hidden + h], shape.ranks_per_ep_rank == 1 ? v : v + v) << name << " entry " << i;
      }
    }
  }
}

TEST(NcclRank, RowExchangeMatchesTheHostPath) {
  FULCRUM_RANK_ONLY(env);
  compare_paths(*env, {100, 8, 64, 16, 1});
  compare_paths(*env, {37, 4, 96, 8, 2});
}

TEST(NcclRowExchange, DevicePathIsBitwiseTheHostPath) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.RowExchangeMatchesTheHostPath"), (std::vector<int>{0, 0}));
}

TEST(CudaGenerate, MoeRowsGoGpuToGpuAndKeepTheCpuTokens) {
  FULCRUM_NEEDS_GPUS(2);
  TempDir dir("cuda_row_exchange");
  const std::string base = tiny_generate_command();
  const CliRun cpu = run_cli(dir, base);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  for (const std::string backend : {"allgather", "alltoall"}) {
    for (const std::string eplb : {"", " --enable-eplb --ep-num-redundant-experts 2 --eplb-rebalance-num-iterations 2"}) {
      const CliRun gpus = run_cli(dir, base + " --device cuda --tp 2 --ep 2 --moe-a2a-backend " + backend + eplb);
      ASSERT_EQ(gpus.exit_code, 0) << gpus.err;
      EXPECT_EQ(tokens_of(gpus.out), tokens_of(cpu.out)) << backend << eplb;
      EXPECT_NE(gpus.out.find("# moe exchange: " + backend + " (device path"), std::string::npos) << gpus.out;
      std::printf("%s%s:\n%s", backend.c_str(), eplb.c_str(), gpus.out.c_str());
    }
  }
}

}  // namespace
}  // namespace fulcrum::test
