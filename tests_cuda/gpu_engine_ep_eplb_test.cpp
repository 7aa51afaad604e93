// Live EPLB on the GPU engine's expert-parallel ranks: slots moving rank to rank through the exchange
// (GpuSlotPool::migrate_layer_over), GpuEngine::apply_placement on EP ranks, and `generate` / `serve --device cuda
// --tp 2 --dp 2 --enable-dp-attention --ep 2 --enable-eplb` (gpu::GpuRankEplb). Two ranks as threads on one GPU,
// rows and slots staged through the host (comm::HostStagedExchange).
// Exact: migrated slots byte for byte (bf16 and FP8 with its scales) what a pool filled with the new experts holds;
// an engine after a live placement gives the logits bit for bit of engines built at that placement. Tolerance of
// the EP ranks against one GPU: kEpRelTolerance (gpu_engine_ep_util.hpp); the CLI and server runs compare greedy
// tokens, whose margins on the golden tiny model are clear (as GenerateOnRankThreadsPrintsTheOneGpuTokens).
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "comm/host_staged_exchange.hpp"
#include "comm/in_process_communicator.hpp"
#include "eplb/error.hpp"
#include "gpu/moe/gpu_slot_pool.hpp"
#include "gpu_engine_ep_util.hpp"
#include "moe_cuda_test_util.hpp"

namespace fulcrum::test {
namespace {

constexpr uint64_t kSeed = 77;

// Every local slot's blobs of one layer, in slot order.
std::vector<std::pair<std::vector<std::byte>, std::vector<std::byte>>> layer_blobs(const backend::GpuSlotPool& pool,
                                                                                    int layer) {
  std::vector<std::pair<std::vector<std::byte>, std::vector<std::byte>>> out;
  for (int s = 0; s < pool.shape().slots_per_layer; ++s) out.push_back(pool.download_blobs(pool.map().buffer_of(layer, s)));
  return out;
}

// Two ranks of 4 slots a layer (P = 8) move layer 1 from old_row to new_row: experts that cross ranks both ways, one
// kept, one copied locally; layer 0 keeps its row. Each rank's slots then hold, byte for byte,
// what a pool filled with new_row's experts holds (bf16, and FP8 blobs with their scales), and layer 0 is untouched.
void check_migration(bool fp8) {
  const backend::SlotPoolShape shape{.num_layers = 2, .slots_per_layer = 4, .hidden_size = fp8 ? 256 : 64,
                                     .moe_intermediate_size = fp8 ? 128 : 32, .fp8 = fp8};
  const std::vector<int32_t> old_row = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int32_t> new_row = {5, 1, 7, 6, 0, 2, 3, 4};
  std::array<int, kRanks> received{};
  comm::run_in_process(kRanks, [&](int rank, comm::Communicator& comm) {
    FULCRUM_CUDA_CHECK(cudaSetDevice(0));
    comm::HostStagedExchange exchange(comm, 0);
    backend::GpuSlotPool pool(shape, 0);
    const auto part = [&](const std::vector<int32_t>& row) {
      return std::vector<int32_t>(row.begin() + rank * 4, row.begin() + (rank + 1) * 4);
    };
    for (int layer = 0; layer < 2; ++layer) pool.fill_layer(layer, part(old_row), kSeed);
    const auto layer0 = layer_blobs(pool, 0);
    received[static_cast<size_t>(rank)] = pool.migrate_layer_over(exchange, 1, old_row, new_row);
    backend::GpuSlotPool expected(shape, 0);
    expected.fill_layer(1, part(new_row), kSeed);
    EXPECT_EQ(layer_blobs(pool, 1), layer_blobs(expected, 1)) << "rank " << rank;
    EXPECT_EQ(layer_blobs(pool, 0), layer0) << "rank " << rank;
    EXPECT_EQ(pool.map().num_free(), 4) << "the spare buffers went back";
    // A row naming an expert no slot holds: a one-line error before anything moves (every rank, no exchange).
    std::vector<int32_t> bad = new_row;
    bad[0] = 9;
    EXPECT_THROW(pool.migrate_layer_over(exchange, 1, new_row, bad), Error);
    EXPECT_EQ(layer_blobs(pool, 1), layer_blobs(expected, 1));
  });
  // Rank 0's slots 0 (5), 2 (7) and 3 (6), all from rank 1; rank 1's 4 (0), 5 (2), 6 (3) from rank 0, and 7 (4, a
  // local copy).
  EXPECT_EQ(received[0], 3);
  EXPECT_EQ(received[1], 4);
}

TEST(GpuEngineEpEplb, SlotsMoveBetweenRanksByteForByte) {
  if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  check_migration(/*fp8=*/false);
  check_migration(/*fp8=*/true);
}

// Another placement of the same slots (experts permuted otherwise, other replicas).
eplb::Placement second_placement(const model::Qwen3MoeConfig& config, int slots, int gpus) {
  eplb::Placement p = moved_placement(config, slots, gpus);
  const int e = config.num_experts;
  for (int l = 0; l < p.num_layers; ++l) {
    for (int s = 0; s < slots; ++s) p.layer(l)[static_cast<size_t>(s)] = s < e ? (s * 5 + 3 + l) % e : (s - e + 5) % e;
  }
  return p;
}

// EP ranks started at one placement and moved live to another give the logits, bit for bit, of EP ranks built at the
// second, and both stay within kEpRelTolerance of one GPU; each rank received slots.
TEST(GpuEngineEpEplb, LivePlacementOnRanksEqualsRanksBuiltAtIt) {
  if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const model::Qwen3MoeConfig config = small_config();
  const int slots = config.num_experts + 8;
  const eplb::Placement first = moved_placement(config, slots, kRanks), second = second_placement(config, slots, kRanks);
  std::array<int64_t, kRanks> moved{};
  const auto kStatic = eplb::DispatchAlgorithm::kStatic;
  const std::vector<std::vector<float>> live = ep_logits(config, first, kStatic, false, &second, &moved);
  const std::vector<std::vector<float>> built = ep_logits(config, second, kStatic, false);
  EXPECT_EQ(live, built);
  EXPECT_GT(moved[0], 0);
  EXPECT_GT(moved[1], 0);
  std::vector<std::vector<float>> one_gpu;
  {
    gpu::GpuEngine engine(config, ep_options());
    engine.fill_random(21);
    one_gpu = last_logits_together(engine, ep_prompts(config.vocab_size), 0);
  }
  ASSERT_EQ(live.size(), one_gpu.size());
  for (size_t i = 0; i < live.size(); ++i) {
    const double rel = relative_error(live[i], one_gpu[i]);
    EXPECT_LE(rel, kEpRelTolerance) << "prompt " << i;
    std::printf("[ ep live placement ] prompt %zu: rel %.2e vs one GPU, slots moved %lld / %lld\n", i, rel,
                static_cast<long long>(moved[0]), static_cast<long long>(moved[1]));
  }
}

constexpr const char* kEplbFlags =
    " --enable-eplb --ep-num-redundant-experts 2 --eplb-rebalance-num-iterations 2";

// `generate` on 2 GPU engine rank threads with live EPLB (a rebalance every 2 steps) prints the one-GPU engine's
// tokens and the rebalances it ran.
TEST(GpuEngineEpEplb, GenerateOnRankThreadsWithEplbPrintsTheOneGpuTokens) {
  TempDir dir("gpu_ep_eplb_generate");
  const std::string base = tiny_generate_command() + " --device cuda";
  const CliRun one = run_cli(dir, base);
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const CliRun ranks = run_cli(dir, base + " --tp 2 --dp 2 --enable-dp-attention --ep 2" + kEplbFlags);
  ASSERT_EQ(ranks.exit_code, 0) << ranks.err;
  EXPECT_EQ(tokens_of(ranks.out), tokens_of(one.out));
  EXPECT_NE(ranks.out.find("# eplb: 3 rebalances"), std::string::npos) << ranks.out;  // after steps 2, 4 and 6
  EXPECT_NE(ranks.out.find("# eplb: rebalance 0 at pass 2"), std::string::npos) << ranks.out;
  std::printf("%s%s", ranks.out.c_str(), ranks.err.c_str());
}

// `serve` on 2 GPU engine rank threads with live EPLB answers 4 concurrent greedy requests with the one-GPU server's
// tokens, and /metrics reports the balancedness the rebalances measured.
TEST(GpuEngineEpEplb, ServeOnRankThreadsWithEplbAnswersAsOneGpu) {
  const auto one = serve_greedy_answers({}, "gpu_serve_eplb_one");
  std::string metrics;
  const auto ranks = serve_greedy_answers({"--tp", "2", "--dp", "2", "--enable-dp-attention", "--ep", "2", "--enable-eplb",
                                           "--ep-num-redundant-experts", "2", "--eplb-rebalance-num-iterations", "2"},
                                          "gpu_serve_eplb_ranks", &metrics);
  EXPECT_EQ(ranks, one);
  // A number once a rebalance has measured the window (NaN before).
  const std::string key = "\nfulcrum_eplb_balancedness_mean ";
  const size_t at = metrics.find(key);
  ASSERT_NE(at, std::string::npos) << metrics;
  const double mean = std::strtod(metrics.c_str() + at + key.size(), nullptr);
  EXPECT_GT(mean, 0.0) << metrics;
  EXPECT_LE(mean, 1.0) << metrics;
}

}  // namespace
}  // namespace fulcrum::test
