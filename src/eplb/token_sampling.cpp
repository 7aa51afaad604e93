#include "eplb/token_sampling.hpp"

#include <algorithm>
#include <numeric>

namespace fulcrum::eplb {

std::vector<double> inclusion_probabilities(std::span<const double> load, int top_k) {
  const int num_experts = static_cast<int>(load.size());
  std::vector<double> pi(num_experts, 0.0);
  std::vector<bool> capped(num_experts, false);
  for (int num_capped = 0;;) {
    double free_load = 0.0;
    for (int e = 0; e < num_experts; ++e) free_load += capped[e] ? 0.0 : load[e];
    bool changed = false;
    for (int e = 0; e < num_experts; ++e) {
      if (capped[e]) continue;
      pi[e] = free_load > 0.0 ? (top_k - num_capped) * load[e] / free_load : 0.0;
      if (pi[e] >= 1.0) {
        pi[e] = 1.0;
        capped[e] = true;
        ++num_capped;
        changed = true;
      }
    }
    if (!changed) return pi;
  }
}

TokenSampler::TokenSampler(std::span<const double> pi, int top_k, SplitMix64& order_rng)
    : top_k_(top_k), order_(pi.size()), upper_(pi.size()) {
  std::iota(order_.begin(), order_.end(), 0);
  for (size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[order_rng.below(static_cast<uint32_t>(i))]);
  double sum = 0.0;
  for (size_t i = 0; i < order_.size(); ++i) upper_[i] = (sum += pi[order_[i]]);
  for (double& u : upper_) u *= top_k / sum;  // exact total: u + top_k - 1 always falls inside
}

void TokenSampler::draw(SplitMix64& rng, std::vector<int>& chosen) const {
  chosen.clear();
  const double u = rng.uniform();
  auto from = upper_.begin();
  for (int j = 0; j < top_k_; ++j) {
    from = std::upper_bound(from, upper_.end(), u + j);
    chosen.push_back(order_[std::min<size_t>(from - upper_.begin(), order_.size() - 1)]);
  }
}

}  // namespace fulcrum::eplb
