// Sampled tokens reproduce a load profile: distinct top-k experts, marginals equal to the load fractions.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <set>

#include "eplb/loads.hpp"
#include "eplb/token_sampling.hpp"
#include "test_data.hpp"

namespace fulcrum::eplb {
namespace {

TEST(TokenSampling, InclusionProbabilitiesCapAtOneAndSumToTopK) {
  const std::vector<double> load{100, 1, 1, 1, 1, 0};
  const auto pi = inclusion_probabilities(load, 2);
  EXPECT_DOUBLE_EQ(pi[0], 1.0);  // would be 2 * 100 / 104 > 1
  for (int e = 1; e < 5; ++e) EXPECT_DOUBLE_EQ(pi[e], 0.25);
  EXPECT_DOUBLE_EQ(pi[5], 0.0);
  EXPECT_NEAR(std::accumulate(pi.begin(), pi.end(), 0.0), 2.0, 1e-12);
}

TEST(TokenSampling, RealLayerMarginalsMatchTheRecordedFractions) {
  // Real Qwen3-30B-A3B layer: value = fraction of tokens whose top-8 includes the expert.
  const LoadMatrix loads = read_loads_file(test::shared_path("data/loads/qwen3-30b-a3b_prefill_copa_he.csv"));
  const auto layer = loads.layer(17);
  const auto pi = inclusion_probabilities(layer, 8);
  SplitMix64 rng(11);
  const TokenSampler sampler(pi, 8, rng);
  const int num_tokens = 200000;
  std::vector<int> counts(loads.num_logical_experts, 0);
  std::vector<int> chosen;
  for (int t = 0; t < num_tokens; ++t) {
    sampler.draw(rng, chosen);
    ASSERT_EQ(chosen.size(), 8u);
    ASSERT_EQ(std::set<int>(chosen.begin(), chosen.end()).size(), 8u) << "duplicate expert in one token";
    for (int e : chosen) ++counts[e];
  }
  const double row_sum = std::accumulate(layer.begin(), layer.end(), 0.0);
  for (int e = 0; e < loads.num_logical_experts; ++e) {
    const double expected = 8.0 * layer[e] / row_sum;  // the recorded fraction, renormalized to top-8
    const double sigma = std::sqrt(num_tokens * expected * (1 - expected)) + 1.0;
    EXPECT_NEAR(counts[e], num_tokens * expected, 5 * sigma) << "expert " << e;
  }
}

}  // namespace
}  // namespace fulcrum::eplb
