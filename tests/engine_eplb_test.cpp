// EPLB inside the parallel engine: generation that rebalances and migrates slots mid-generation (every
// 1-2 passes, redundant slots, layers switching one per pass) gives the plain single-rank run's logits
// (<= 1e-5) and tokens, over a representative matrix of EP / PP / a2a backend / dispatch algorithm;
// sampling is seeded, deterministic and the same across layouts.
#include <gtest/gtest.h>

#include "engine/parallel_generate.hpp"
#include "engine_test_util.hpp"

namespace fulcrum::test {
namespace {

constexpr float kTolerance = 1e-5f;

const std::vector<std::vector<int32_t>> kPrompts = {{3, 17, 250, 9, 41, 7, 7}, {200, 1}, {0, 8, 99, 12, 5}, {77}};

struct DecodeRun {
  model::GenerateResult generated;
  std::vector<std::vector<model::HostTensor>> logits;  // per forward pass, per sequence (world rank 0)
  std::vector<eplb_runtime::RebalanceReport> rebalances;
  int64_t layers_switched = 0;
};

// Every forward pass's logits, on the way through.
class LoggingTarget final : public model::DecodeTarget {
 public:
  LoggingTarget(model::DecodeTarget& inner, std::vector<std::vector<model::HostTensor>>& log) : inner_(inner), log_(log) {}
  void reset(const std::vector<int64_t>& capacities) override { inner_.reset(capacities); }
  std::vector<model::HostTensor> forward(const std::vector<std::vector<int32_t>>& new_tokens) override {
    log_.push_back(inner_.forward(new_tokens));
    return log_.back();
  }

 private:
  model::DecodeTarget& inner_;
  std::vector<std::vector<model::HostTensor>>& log_;
};

// model::generate on in-process ranks, each with its RankEplb when `eplb` is given.
DecodeRun decode(const std::string& name, const engine::ParallelFlags& flags, const engine::EngineOptions& options,
                 const engine::EplbSettings* eplb, const model::DecodeOptions& decode_options) {
  const Fixture& f = fixture(name);
  const engine::ParallelLayout layout(flags, f.config);
  const eplb::Placement initial = eplb::trivial_placement({layout.num_physical_experts(), layout.ep(), 1},
                                                          static_cast<int>(f.config.moe_layer_indices().size()),
                                                          f.config.num_experts);
  std::vector<DecodeRun> runs(static_cast<size_t>(layout.world_size()));
  comm::run_in_process(layout.world_size(), [&](int rank, comm::Communicator& world) {
    backend::CpuBackend cpu;
    engine::RankEngine engine(f.config, layout, world, cpu, &initial, options);
    model::Checkpoint checkpoint(golden_model_dir(name));
    engine.load_weights(checkpoint);
    std::unique_ptr<engine::RankEplb> rank_eplb;
    if (eplb != nullptr) rank_eplb = std::make_unique<engine::RankEplb>(engine, world, cpu, initial, *eplb);
    engine::RankDecodeTarget target(engine, rank_eplb.get());
    DecodeRun& run = runs[static_cast<size_t>(rank)];
    LoggingTarget logging(target, run.logits);
    run.generated = model::generate(logging, kPrompts, decode_options);
    if (rank_eplb != nullptr) {
      run.rebalances = rank_eplb->rebalances();
      run.layers_switched = rank_eplb->migration_totals().num_layers_switched;
    }
  });
  for (const DecodeRun& other : runs) EXPECT_EQ(other.generated.new_tokens, runs[0].generated.new_tokens);
  return runs[0];
}

model::DecodeOptions greedy(int max_new_tokens) {
  model::DecodeOptions options;
  options.max_new_tokens = max_new_tokens;
  return options;
}

struct Case {
  const char* model;
  engine::ParallelFlags flags;
  const char* backend;
  eplb::DispatchAlgorithm dispatch;
  int rebalance_every;
  int layers_per_chunk;
};

TEST(EngineEplb, RebalancingMidGenerationKeepsLogitsAndTokens) {
  using eplb::DispatchAlgorithm;
  const std::vector<Case> cases = {
      {k128e, {2, 1, 2, 1, false, 2}, "allgather", DispatchAlgorithm::kStatic, 1, 0},
      {k128e, {4, 1, 4, 1, false, 4}, "alltoall", DispatchAlgorithm::kDynamic, 2, 1},
      {k128e, {4, 1, 2, 2, false, 2}, "allgather", DispatchAlgorithm::kBalanced, 1, 0},  // 2 ranks per EP rank
      {k128e, {4, 2, 4, 2, true, 4}, "alltoall", DispatchAlgorithm::kStatic, 1, 2},     // DP attention, PP 2
      {kDenseMix, {2, 1, 2, 2, false, 2}, "alltoall", DispatchAlgorithm::kBalanced, 1, 0},
      {kFp8, {2, 1, 2, 1, false, 2}, "alltoall", DispatchAlgorithm::kStatic, 1, 0},  // FP8 weights + block scales
  };
  const int max_new_tokens = 6;
  for (const Case& c : cases) {
    const std::string label = fmt::format("{} tp{} dp{} ep{} pp{} R{} {} {}", c.model, c.flags.tp, c.flags.dp,
                                          c.flags.ep, c.flags.pp, c.flags.num_redundant_experts, c.backend,
                                          eplb::to_string(c.dispatch));
    SCOPED_TRACE(label);
    const DecodeRun plain = decode(c.model, {}, {}, nullptr, greedy(max_new_tokens));
    engine::EngineOptions options;
    options.moe_a2a_backend = c.backend;
    options.dispatch_algorithm = c.dispatch;
    engine::EplbSettings settings;
    settings.enabled = true;
    settings.rebalance_num_iterations = c.rebalance_every;
    settings.rebalance_layers_per_chunk = c.layers_per_chunk;
    settings.recorder_buffer_size = 3;
    settings.skip_balancedness = 1.0;  // replan whenever the planner improves a layer
    settings.log = [](const std::string&) {};
    const DecodeRun live = decode(c.model, c.flags, options, &settings, greedy(max_new_tokens));
    EXPECT_EQ(live.generated.new_tokens, plain.generated.new_tokens);
    EXPECT_LE(max_logit_diff(live.logits, plain.logits), kTolerance);
    int changed = 0;
    for (const auto& report : live.rebalances) changed += report.skipped ? 0 : 1;
    EXPECT_GE(changed, 1) << "no rebalance changed the placement";
    EXPECT_GE(live.layers_switched, 1) << "no layer migrated on rank 0";
  }
}

// An FP8 checkpoint (weights and their block scales, dequantized at load) under the same layout with and
// without live rebalancing: the experts each slot holds move with their scales, so every pass's logits are
// bitwise those of the run that never migrates.
TEST(EngineEplb, Fp8RebalancingIsBitwiseTheStaticRun) {
  const engine::ParallelFlags flags{2, 1, 2, 1, false, 4};
  engine::EngineOptions options;
  options.moe_a2a_backend = "allgather";
  const DecodeRun fixed = decode(kFp8, flags, options, nullptr, greedy(6));
  engine::EplbSettings settings;
  settings.enabled = true;
  settings.rebalance_num_iterations = 1;
  settings.recorder_buffer_size = 3;
  settings.skip_balancedness = 1.0;
  settings.log = [](const std::string&) {};
  const DecodeRun live = decode(kFp8, flags, options, &settings, greedy(6));
  EXPECT_GE(live.layers_switched, 1) << "no layer migrated on rank 0";
  EXPECT_EQ(live.generated.new_tokens, fixed.generated.new_tokens);
  ASSERT_EQ(live.logits.size(), fixed.logits.size());
  for (size_t pass = 0; pass < live.logits.size(); ++pass) {
    for (size_t seq = 0; seq < live.logits[pass].size(); ++seq) {
      EXPECT_EQ(live.logits[pass][seq].data, fixed.logits[pass][seq].data) << "pass " << pass << " sequence " << seq;
    }
  }
}

TEST(EngineEplb, RecordingWithoutEplbOnOneRankAndRefusingEplbThere) {
  const DecodeRun plain = decode(k128e, {}, {}, nullptr, greedy(3));
  engine::EplbSettings record_only;  // not enabled: the recorder only counts
  const DecodeRun recorded = decode(k128e, {}, {}, &record_only, greedy(3));
  EXPECT_EQ(recorded.generated.new_tokens, plain.generated.new_tokens);
  EXPECT_TRUE(recorded.rebalances.empty());
  const engine::ParallelLayout one_rank({}, fixture(k128e).config);
  EXPECT_NE(engine::why_eplb_cannot_run(one_rank, fixture(k128e).config).find("single EP rank"), std::string::npos);
}

TEST(EngineEplb, SeededSamplingIsDeterministicAndTheSameAcrossLayouts) {
  model::DecodeOptions sampled = greedy(8);
  sampled.sampling = {0.9f, 0.95f, 40};
  sampled.seed = 1234;
  const DecodeRun a = decode(k128e, {}, {}, nullptr, sampled);
  const DecodeRun b = decode(k128e, {}, {}, nullptr, sampled);
  EXPECT_EQ(a.generated.new_tokens, b.generated.new_tokens);
  engine::EplbSettings settings;
  settings.enabled = true;
  settings.rebalance_num_iterations = 1;
  settings.skip_balancedness = 1.0;
  settings.log = [](const std::string&) {};
  const DecodeRun parallel = decode(k128e, {4, 2, 4, 1, true, 4}, {}, &settings, sampled);
  EXPECT_EQ(parallel.generated.new_tokens, a.generated.new_tokens);
  sampled.seed = 99;  // another seed draws other tokens (sampling is really on)
  EXPECT_NE(decode(k128e, {}, {}, nullptr, sampled).generated.new_tokens, a.generated.new_tokens);
}

}  // namespace
}  // namespace fulcrum::test
