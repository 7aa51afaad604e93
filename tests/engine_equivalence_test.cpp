// The parallel engine against the single-rank model on the golden fixtures: every layout x dispatch backend
// x dispatch algorithm x placement (trivial without redundancy, planned from recorded router counts with
// redundant slots) gives the same logits within 1e-5. Tensor parallelism changes fp32 summation order
// (partial sums all-reduced), hence the tolerance; with tp 1 per stage the logits are bitwise equal.
#include <cstdio>

#include <gtest/gtest.h>

#include "engine_test_util.hpp"

namespace fulcrum::test {
namespace {

constexpr float kTolerance = 1e-5f;

struct LayoutCase {
  const char* model;
  engine::ParallelFlags flags;  // num_redundant_experts is set per placement kind
  const char* what;
};

engine::ParallelFlags flags(int tp, int dp, int ep, int pp) {
  engine::ParallelFlags f;
  f.tp = tp;
  f.dp = dp;
  f.ep = ep;
  f.pp = pp;
  f.enable_dp_attention = dp > 1;
  return f;
}

const std::vector<LayoutCase>& layouts() {
  static const std::vector<LayoutCase> cases = {
      {k128e, flags(1, 1, 1, 1), "one rank"},
      {k128e, flags(2, 1, 1, 1), "TP 2, experts split by intermediate"},
      {k128e, flags(2, 1, 2, 1), "TP 2, EP 2"},
      {k128e, flags(4, 1, 4, 1), "TP 4, EP 4"},
      {k128e, flags(4, 1, 2, 1), "TP 4, EP 2 (2 ranks per EP rank)"},
      {k128e, flags(2, 2, 2, 1), "DP attention 2 x 1, EP 2"},
      {k128e, flags(4, 2, 4, 1), "DP attention 2 x 2, EP 4"},
      {k128e, flags(4, 4, 4, 1), "DP attention 4 x 1 (one group without sequence), EP 4"},
      {k128e, flags(2, 1, 2, 2), "PP 2, TP 2, EP 2"},
      {k128e, flags(1, 1, 1, 3), "PP 3, one rank per stage"},
      {kDenseMix, flags(4, 1, 4, 1), "TP 4 over 2 kv heads (replicated), EP 4"},
      {kDenseMix, flags(2, 1, 2, 4), "PP 4 (stage 2 holds only the dense layer), TP 2, EP 2"},
      {kDenseMix, flags(2, 2, 1, 2), "PP 2, DP attention 2 x 1, EP 1"},
      {kDenseMix, flags(4, 2, 2, 2), "PP 2, DP attention 2 x 2, EP 2"},
  };
  return cases;
}

class EngineEquivalence : public ::testing::TestWithParam<size_t> {};

TEST_P(EngineEquivalence, AllBackendsAlgorithmsAndPlacementsMatchSingleRank) {
  const LayoutCase& layout_case = layouts()[GetParam()];
  const Fixture& f = fixture(layout_case.model);
  float worst = 0;
  for (const bool planned : {false, true}) {
    engine::ParallelFlags run_flags = layout_case.flags;
    run_flags.num_redundant_experts = planned ? std::max(2, run_flags.ep) : 0;
    const int num_physical = f.config.num_experts + run_flags.num_redundant_experts;
    const eplb::Placement placement = planned_placement(layout_case.model, num_physical, run_flags.ep);
    for (const char* backend : {"allgather", "alltoall"}) {
      for (const auto algorithm : {eplb::DispatchAlgorithm::kStatic, eplb::DispatchAlgorithm::kDynamic,
                                   eplb::DispatchAlgorithm::kBalanced}) {
        engine::EngineOptions options;
        options.moe_a2a_backend = backend;
        options.dispatch_algorithm = algorithm;
        const PassLogits logits = run_engine(layout_case.model, run_flags, options, planned ? &placement : nullptr);
        const float diff = max_logit_diff(logits, f.reference);
        EXPECT_LE(diff, kTolerance) << layout_case.what << ", " << backend << ", " << eplb::to_string(algorithm)
                                    << (planned ? ", planned" : ", trivial");
        if (run_flags.tp == 1) {
          EXPECT_EQ(diff, 0.0f) << layout_case.what;  // no partial sums anywhere
        }
        worst = std::max(worst, diff);
      }
    }
  }
  std::printf("[ layout   ] %-28s %-60s max |logit diff| %.3g\n", layout_case.model, layout_case.what, worst);
}

INSTANTIATE_TEST_SUITE_P(Layouts, EngineEquivalence, ::testing::Range<size_t>(0, layouts().size()));

// The seeds' server configuration: --tp 8 --dp 2 --enable-dp-attention --ep 8 --moe-a2a-backend alltoall
// --ep-num-redundant-experts 8 --ep-dispatch-algorithm static, on 8 in-process ranks.
TEST(EngineSeeds, SeedsConfigurationGivesThePlainRunsLogits) {
  engine::ParallelFlags seeds = flags(8, 2, 8, 1);
  seeds.num_redundant_experts = 8;
  engine::EngineOptions options;
  options.moe_a2a_backend = "alltoall";
  options.dispatch_algorithm = eplb::DispatchAlgorithm::kStatic;
  const float diff = max_logit_diff(run_engine(k128e, seeds, options), fixture(k128e).reference);
  EXPECT_LE(diff, kTolerance);
  const eplb::Placement planned = planned_placement(k128e, 136, 8);
  EXPECT_LE(max_logit_diff(run_engine(k128e, seeds, options, &planned), fixture(k128e).reference), kTolerance);
  std::printf("[ layout   ] seeds' configuration (8 ranks): max |logit diff| %.3g\n", diff);
}

}  // namespace
}  // namespace fulcrum::test
