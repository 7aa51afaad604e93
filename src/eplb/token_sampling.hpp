#pragma once
// Sampling tokens' top-k experts so that a replayed batch reproduces a recorded load profile.
#include <span>
#include <vector>

#include "eplb/dispatch.hpp"

namespace fulcrum::eplb {

// Per-token inclusion probabilities: pi_e = top_k * load_e / W, capped at 1 with the capped mass spread over
// the others, so that sampled tokens reproduce the window's load profile (an expert's expected share of
// the tokens equals its load fraction, as in recorded top-k counts). Sums to top_k when at least top_k
// experts have positive load.
std::vector<double> inclusion_probabilities(std::span<const double> load, int top_k);

// Systematic sampling: experts laid end to end (in a random order drawn at construction) on [0, top_k) with
// widths pi_e; a token takes the experts under u, u + 1, ..., u + top_k - 1 for one uniform u in [0, 1).
// Each expert is chosen with probability exactly pi_e, and never twice since no width exceeds 1.
class TokenSampler {
 public:
  TokenSampler(std::span<const double> pi, int top_k, SplitMix64& order_rng);
  void draw(SplitMix64& rng, std::vector<int>& chosen) const;  // chosen: top_k distinct experts

 private:
  int top_k_;
  std::vector<int> order_;     // expert at each position
  std::vector<double> upper_;  // [num_experts] cumulative widths, scaled to end exactly at top_k
};

}  // namespace fulcrum::eplb
