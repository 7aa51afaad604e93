#include "model/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "eplb/error.hpp"

namespace fulcrum::model {

void validate_sampling_params(const SamplingParams& params) {
  FULCRUM_CHECK(std::isfinite(params.temperature) && params.temperature >= 0.0f,
                "sampling: temperature must be finite and >= 0, got {}", params.temperature);
  FULCRUM_CHECK(params.top_p > 0.0f && params.top_p <= 1.0f, "sampling: top_p must be in (0, 1], got {}",
                params.top_p);
  FULCRUM_CHECK(params.top_k >= 0, "sampling: top_k must be >= 0 (0 disables it), got {}", params.top_k);
}

int sample_token(std::span<const float> logits, const SamplingParams& params, Rng& rng) {
  validate_sampling_params(params);
  return sample_token_from_uniform(logits, params, params.temperature == 0.0f ? 0.0 : rng.uniform());
}

int sample_token_from_uniform(std::span<const float> logits, const SamplingParams& params, double uniform) {
  validate_sampling_params(params);
  FULCRUM_CHECK(uniform >= 0.0 && uniform < 1.0, "sampling: uniform draw {} outside [0, 1)", uniform);
  FULCRUM_CHECK(!logits.empty(), "sampling: empty logits");
  bool any_finite = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    FULCRUM_CHECK(!std::isnan(logits[i]) && logits[i] != INFINITY, "sampling: logit of token {} is {}", i, logits[i]);
    any_finite = any_finite || std::isfinite(logits[i]);
  }
  FULCRUM_CHECK(any_finite, "sampling: every logit is -inf");

  if (params.temperature == 0.0f) {  // greedy: first maximum = lowest id on ties
    return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  // Candidates by descending logit, equal logits by lower id.
  std::vector<int> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const size_t keep = params.top_k > 0 ? std::min(order.size(), static_cast<size_t>(params.top_k)) : order.size();
  const auto by_logit = [&](int a, int b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(), by_logit);
  order.resize(keep);

  // Softmax over the kept candidates, in double.
  const double max_logit = logits[order[0]];
  const double inv_temperature = 1.0 / static_cast<double>(params.temperature);
  std::vector<double> weights(keep);  // [keep], unnormalized
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    weights[i] = std::exp((static_cast<double>(logits[order[i]]) - max_logit) * inv_temperature);
    total += weights[i];
  }
  // Nucleus: the smallest prefix whose probability reaches top_p (top_p = 1 keeps every candidate).
  size_t nucleus = keep;
  if (params.top_p < 1.0f) {
    const double needed = static_cast<double>(params.top_p) * total;
    double cumulative = 0.0;
    for (size_t i = 0; i < keep; ++i) {
      cumulative += weights[i];
      if (cumulative >= needed) {
        nucleus = i + 1;
        break;
      }
    }
  }
  double mass = 0.0;
  for (size_t i = 0; i < nucleus; ++i) mass += weights[i];
  // Inverse-CDF draw; zero-weight candidates are never chosen.
  const double target = uniform * mass;
  double cumulative = 0.0;
  for (size_t i = 0; i < nucleus; ++i) {
    cumulative += weights[i];
    if (target < cumulative) return order[i];
  }
  // Rounding left target at the very top: the last candidate with positive weight.
  for (size_t i = nucleus; i-- > 0;) {
    if (weights[i] > 0.0) return order[i];
  }
  return order[0];
}

}  // namespace fulcrum::model
