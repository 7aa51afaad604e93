#pragma once
// Helpers shared by the MoE reference tests (tests/) and the GPU MoE tests (tests_cuda/).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "eplb/dispatch.hpp"
#include "model/moe_reference.hpp"

namespace fulcrum::test {

// Uniform in [-scale, scale), rounded to bf16 (SplitMix64: the real shapes need hundreds of millions).
inline std::vector<float> random_bf16_values(int64_t n, uint64_t seed, float scale) {
  eplb::SplitMix64 rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = model::moe::round_bf16(static_cast<float>((2.0 * rng.uniform() - 1.0) * scale));
  return v;
}

// ||actual - expected|| / ||expected|| in double; infinity when actual holds a NaN or infinity.
inline double relative_error(const std::vector<float>& actual, const std::vector<float>& expected) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < std::min(actual.size(), expected.size()); ++i) {
    if (!std::isfinite(actual[i])) return INFINITY;
    diff += (double(actual[i]) - expected[i]) * (double(actual[i]) - expected[i]);
    ref += double(expected[i]) * expected[i];
  }
  return std::sqrt(diff / std::max(ref, 1e-30));
}

}  // namespace fulcrum::test
