// The MoE token exchange's rows GPU to GPU (engine::RowExchange, comm::NcclRowExchange) on 2 GPU rank
// processes: both dispatchers (allgather, alltoall) run once with the host-staged rows and once with the
// device rows on the same inputs; dispatched rows and combined outputs must be bitwise equal, and equal to
// their definition. A timing of both paths on a 30B-A3B-like shape follows (figures only, no threshold).
// Then `fulcrum generate --device cuda --tp 2 --ep 2` with both backends, with and without EPLB and
// redundant experts, prints the CPU one-rank tokens and says the rows took the device path.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "comm/nccl_row_exchange.hpp"
#include "engine/token_dispatcher.hpp"
#include "model_test_util.hpp"
#include "nccl_rank_util.hpp"

namespace fulcrum::test {
namespace {

struct Shape {
  int64_t tokens = 0;  // per rank
  int top_k = 0;
  int hidden = 0;
  int num_experts = 0;
  int ranks_per_ep_rank = 1;  // M: 2 makes both ranks hold every slot, so combine sums 2 partials
};

struct ExchangeResult {
  std::vector<float> rows;      // dispatched rows
  std::vector<float> combined;  // combined outputs [my entries, hidden]
  double seconds = 0;           // dispatch + combine, best of the timed repetitions
};

// One dispatch, a stand-in expert (out = 2 * row, for the entries of this rank's slots), one combine.
ExchangeResult exchange(engine::TokenDispatcher& dispatcher, backend::CudaBackend& backend, const model::Tensor& x,
                        const std::vector<int32_t>& token, const std::vector<int32_t>& expert, int rank,
                        const Shape& shape, int repetitions) {
  const int ep_ranks = 2 / shape.ranks_per_ep_rank;
  const int slots_per_ep_rank = shape.num_experts / ep_ranks;
  const int first_slot = rank / shape.ranks_per_ep_rank * slots_per_ep_rank;
  ExchangeResult result;
  result.seconds = 1e30;
  for (int rep = 0; rep < repetitions; ++rep) {
    backend.synchronize();
    const auto start = std::chrono::steady_clock::now();
    engine::DispatchedTokens d = dispatcher.dispatch(x, token, expert, expert);  // slot = expert
    std::vector<int32_t> entries, rows;
    for (size_t i = 0; i < d.expert.size(); ++i) {
      if (d.expert[i] >= first_slot && d.expert[i] < first_slot + slots_per_ep_rank) {
        entries.push_back(static_cast<int32_t>(i));
        rows.push_back(d.entry_row[i]);
      }
    }
    const model::Tensor outputs = backend.zeros({static_cast<int64_t>(d.expert.size()), int64_t{shape.hidden}});
    if (!entries.empty()) {
      const model::Tensor mine = backend.gather_rows(d.rows, rows);
      backend.add_inplace(mine, mine);
      backend.scatter_rows(outputs, mine, entries);
    }
    const model::Tensor combined = dispatcher.combine(outputs);
    backend.synchronize();
    result.seconds = std::min(result.seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (rep == 0) {
      result.rows = backend.download(d.rows);
      result.combined = backend.download(combined);
    }
  }
  return result;
}

void compare_paths(const RankEnv& env, const Shape& shape, int repetitions, bool report) {
  auto world = join_world(env);
  backend::CudaBackend backend(env.rank % backend::CudaBackend::device_count());  // the device join_world chose
  // Inputs: this rank's tokens, each with top_k distinct experts ascending (the engine's entry order).
  std::vector<float> host_x(static_cast<size_t>(shape.tokens * shape.hidden));
  for (size_t i = 0; i < host_x.size(); ++i) host_x[i] = static_cast<float>((i * 2654435761u + env.rank * 97u) % 1000003u) * 1e-3f - 500.0f;
  const model::Tensor x = backend.zeros({shape.tokens, int64_t{shape.hidden}});
  backend.upload(x, host_x);
  std::vector<int32_t> token, expert;
  for (int64_t t = 0; t < shape.tokens; ++t) {
    for (int j = 0; j < shape.top_k; ++j) {
      token.push_back(static_cast<int32_t>(t));
      expert.push_back(static_cast<int32_t>((t * 7 + env.rank * 3 + j * (shape.num_experts / shape.top_k)) % shape.num_experts));
    }
    std::sort(expert.end() - shape.top_k, expert.end());
  }
  const int ep_ranks = 2 / shape.ranks_per_ep_rank;
  for (const std::string name : {"allgather", "alltoall"}) {
    auto make = [&](bool device) {
      std::unique_ptr<engine::RowExchange> rows;
      if (device) rows = std::make_unique<comm::NcclRowExchange>(backend, *world);
      else rows = engine::make_host_row_exchange(*world, backend);
      return engine::make_token_dispatcher(name, *world, backend, shape.hidden, shape.num_experts / ep_ranks,
                                           shape.ranks_per_ep_rank, std::move(rows));
    };
    auto host_dispatcher = make(false), device_dispatcher = make(true);
    const ExchangeResult host = exchange(*host_dispatcher, backend, x, token, expert, env.rank, shape, repetitions);
    const ExchangeResult device = exchange(*device_dispatcher, backend, x, token, expert, env.rank, shape, repetitions);
    EXPECT_EQ(device_dispatcher->row_exchange().path(), "device");
    EXPECT_EQ(device_dispatcher->row_exchange().calls(), 2 * repetitions);
    ASSERT_EQ(host.rows.size(), device.rows.size()) << name;
    EXPECT_TRUE(host.rows == device.rows) << name << ": dispatched rows differ";
    ASSERT_EQ(host.combined.size(), device.combined.size()) << name;
    EXPECT_TRUE(host.combined == device.combined) << name << ": combined outputs differ";
    // Definition: every entry comes back as 2 * its token's row from each of its M ranks.
    ASSERT_EQ(device.combined.size(), token.size() * static_cast<size_t>(shape.hidden)) << name;
    for (size_t i = 0; i < token.size(); ++i) {
      for (int h = 0; h < shape.hidden; h += 97) {
        const float v = host_x[static_cast<size_t>(token[i]) * shape.hidden + h] * 2.0f;
        ASSERT_EQ(device.combined[i * shape.hidden + h], shape.ranks_per_ep_rank == 1 ? v : v + v) << name << " entry " << i;
      }
    }
    if (report && env.rank == 0) {
      std::printf("%-9s %lld tokens/rank x top-%d, hidden %d, M=%d: host-staged %8.3f ms, device %7.3f ms (%.1fx)\n",
                  name.c_str(), static_cast<long long>(shape.tokens), shape.top_k, shape.hidden, shape.ranks_per_ep_rank,
                  host.seconds * 1e3, device.seconds * 1e3, host.seconds / device.seconds);
      std::fflush(stdout);
    }
  }
}

TEST(NcclRank, RowExchangeMatchesTheHostPath) {
  FULCRUM_RANK_ONLY(env);
  compare_paths(*env, {100, 8, 64, 16, 1}, 1, false);
  compare_paths(*env, {37, 4, 96, 8, 2}, 1, false);
}

TEST(NcclRank, RowExchangeTiming) {
  FULCRUM_RANK_ONLY(env);
  compare_paths(*env, {4096, 8, 2048, 128, 1}, 3, true);
}

TEST(NcclRowExchange, DevicePathIsBitwiseTheHostPath) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.RowExchangeMatchesTheHostPath"), (std::vector<int>{0, 0}));
}

TEST(NcclRowExchange, Timing) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.RowExchangeTiming"), (std::vector<int>{0, 0}));
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
