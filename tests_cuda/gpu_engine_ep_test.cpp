// The GPU engine as 2 expert-parallel ranks (GpuEngineOptions::ep): threads sharing one GPU with the rows staged
// through the host (comm::HostStagedExchange over comm::run_in_process), the code that runs over NCCL across GPUs.
// Each rank holds half of every MoE layer's slots and its own sequences (data-parallel attention). Tolerance against
// the one-GPU engine: kEpRelTolerance (gpu_engine_ep_util.hpp says why).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>

#include "backend/cuda/cuda_check.hpp"
#include "comm/host_staged_exchange.hpp"
#include "comm/in_process_communicator.hpp"
#include "eplb/error.hpp"
#include "gpu_engine_ep_util.hpp"
#include "gpu_engine_test_util.hpp"
#include "model_test_util.hpp"
#include "moe_cuda_test_util.hpp"

namespace fulcrum::test {
namespace {

// Two EP ranks give each sequence the one-GPU engine's logits within kEpRelTolerance: the trivial placement, and
// experts permuted with replicas under static and dynamic replica choice; and with rank 1 idle (empty batches).
TEST(GpuEngineEp, RanksMatchTheOneGpuEngine) {
  const model::Qwen3MoeConfig config = small_config();
  const std::vector<std::vector<int32_t>> prompts = ep_prompts(config.vocab_size);
  std::vector<std::vector<float>> one_gpu;
  {
    gpu::GpuEngine engine(config, ep_options());
    engine.fill_random(21);
    one_gpu = last_logits_together(engine, prompts, 0);
  }
  const int num_moe = static_cast<int>(config.moe_layer_indices().size()), e = config.num_experts;
  struct Case {
    const char* name;
    eplb::Placement placement;
    eplb::DispatchAlgorithm dispatch;
    bool rank_one_idle;
  };
  const Case cases[] = {
      {"trivial, static", eplb::trivial_placement(eplb::Topology{e, kRanks, 1}, num_moe, e), eplb::DispatchAlgorithm::kStatic, false},
      {"moved + replicas, static", moved_placement(config, e + 8, kRanks), eplb::DispatchAlgorithm::kStatic, false},
      {"moved + replicas, dynamic", moved_placement(config, e + 8, kRanks), eplb::DispatchAlgorithm::kDynamic, false},
      {"trivial, rank 1 idle", eplb::trivial_placement(eplb::Topology{e, kRanks, 1}, num_moe, e), eplb::DispatchAlgorithm::kStatic, true},
  };
  for (const Case& c : cases) {
    const std::vector<std::vector<float>> ep = ep_logits(config, c.placement, c.dispatch, c.rank_one_idle);
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (c.rank_one_idle && i >= 2) continue;
      ASSERT_EQ(ep[i].size(), one_gpu[i].size()) << c.name << ", prompt " << i;
      const double rel = relative_error(ep[i], one_gpu[i]);
      EXPECT_LE(rel, kEpRelTolerance) << c.name << ", prompt " << i;
      std::printf("[ ep 2 ranks ] %s, prompt of %zu: rel %.2e\n", c.name, prompts[i].size(), rel);
    }
  }
}

// Greedy decoding in lockstep on 2 EP ranks, eagerly: rank 1 idles (empty steps) for the first half, then decodes
// its own sequence; every step of each rank gives finite logprobs, and each rank's tokens equal those of the same
// run again (EP steps are deterministic). Misuse is a one-line error: a placement over another number of GPUs, at
// construction or live.
TEST(GpuEngineEp, LockstepDecodeWithAnIdleRankIsDeterministic) {
  const model::Qwen3MoeConfig config = small_config();
  const int steps = 6;
  const auto run = [&] {
    std::array<std::vector<int32_t>, kRanks> tokens;
    comm::run_in_process(kRanks, [&](int rank, comm::Communicator& comm) {
      FULCRUM_CUDA_CHECK(cudaSetDevice(0));
      comm::HostStagedExchange exchange(comm, 0);
      gpu::GpuEngineOptions o = ep_options();
      o.ep = &exchange;
      gpu::GpuEngine engine(config, o);
      engine.fill_random(5);
      const std::vector<int32_t> prompt = random_tokens(20 + 13 * rank, config.vocab_size, 30 + rank);
      engine.allocate(rank, 64);
      std::vector<int32_t> last;
      for (int s = 0; s < steps; ++s) {
        std::vector<model::StepSequence> batch;
        if (rank == 0 || s >= steps / 2) {
          batch.push_back(last.empty() ? entry(rank, prompt, true) : entry(rank, std::span(last), true));
          batch.back().want_logprob = true;
        }
        const model::StepOutput out = engine.step(batch);
        ASSERT_EQ(out.tokens.size(), batch.size());
        if (batch.empty()) continue;
        ASSERT_TRUE(out.errors[0].empty()) << out.errors[0];
        EXPECT_TRUE(std::isfinite(out.logprobs[0])) << "rank " << rank << " step " << s;
        last = {out.tokens[0]};
        tokens[static_cast<size_t>(rank)].push_back(out.tokens[0]);
      }
      EXPECT_EQ(engine.counters().graph_replays, 0);
      const int num_moe = static_cast<int>(config.moe_layer_indices().size());
      EXPECT_THROW(engine.apply_placement(eplb::trivial_placement(eplb::Topology{config.num_experts, 1, 1}, num_moe,
                                                                  config.num_experts)),
                   Error);  // a placement over one GPU for two ranks
    });
    return tokens;
  };
  const auto a = run(), b = run();
  EXPECT_EQ(a[0].size(), static_cast<size_t>(steps));
  EXPECT_EQ(a[1].size(), static_cast<size_t>(steps - steps / 2));
  EXPECT_EQ(a, b);

  // A placement over one GPU for two ranks: refused before anything is allocated (each rank alone, no collective).
  comm::run_in_process(kRanks, [&](int /*rank*/, comm::Communicator& comm) {
    comm::HostStagedExchange exchange(comm, 0);
    gpu::GpuEngineOptions o = ep_options();
    o.ep = &exchange;
    const int num_moe = static_cast<int>(config.moe_layer_indices().size());
    o.placement = eplb::trivial_placement(eplb::Topology{config.num_experts, 1, 1}, num_moe, config.num_experts);
    EXPECT_THROW(gpu::GpuEngine(config, o), Error);
  });
}

// `generate --device cuda --tp 2 --dp 2 --enable-dp-attention --ep 2`: two GPU engine ranks as threads of one
// process (prompt i on rank i % 2) print the one-GPU engine's tokens on the golden tiny model; a weight cache with
// them is a one-line error.
TEST(GpuEngineEp, GenerateOnRankThreadsPrintsTheOneGpuTokens) {
  TempDir dir("gpu_ep_generate");
  const std::string base = tiny_generate_command() + " --device cuda";
  const CliRun one = run_cli(dir, base);
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const CliRun ranks = run_cli(dir, base + " --tp 2 --dp 2 --enable-dp-attention --ep 2");
  ASSERT_EQ(ranks.exit_code, 0) << ranks.err;
  EXPECT_EQ(tokens_of(ranks.out), tokens_of(one.out));
  EXPECT_NE(ranks.out.find("2 GPU engine ranks"), std::string::npos) << ranks.out;
  std::printf("one GPU:\n%s2 EP ranks:\n%s", one.out.c_str(), ranks.out.c_str());
  const CliRun cached = run_cli(dir, base + " --tp 2 --dp 2 --enable-dp-attention --ep 2 --weight-cache " + dir.file("cache"));
  EXPECT_NE(cached.exit_code, 0);
  EXPECT_NE(cached.err.find("--weight-cache"), std::string::npos) << cached.err;
}

// `serve --device cuda --tp 2 --dp 2 --enable-dp-attention --ep 2`: GPU engine EP rank threads behind the scheduler
// (server::GpuRanksExecutor, one attention-DP group per rank) answer 4 concurrent greedy requests with the tokens a
// one-GPU `serve --device cuda` gives them.
TEST(GpuEngineEp, ServeOnRankThreadsAnswersAsOneGpu) {
  const auto one = serve_greedy_answers({}, "gpu_serve_one");
  const auto ranks = serve_greedy_answers({"--tp", "2", "--dp", "2", "--enable-dp-attention", "--ep", "2"}, "gpu_serve_ep");
  for (const auto& t : one) EXPECT_EQ(t.size(), static_cast<size_t>(kServeMaxTokens));
  EXPECT_EQ(ranks, one);
}

}  // namespace
}  // namespace fulcrum::test
