#pragma once
// Router skew: calibrates the router bias channel of a synthetic checkpoint (synthetic_model.hpp) so that
// routing marginals follow a load matrix, and measures how well they do.
//
// Targets: MoE layer k of the model follows row (k mod loads.num_layers) of the load matrix (rows cycle
// when the model has more MoE layers, extra rows are ignored when it has fewer); the loads' experts must
// equal the model's. The target inclusion fraction of expert e (fraction of tokens whose top-k includes
// e) is loads[row][e] / sum(loads[row]) * top_k; each must be <= 1.
//
// Calibration (all on the CPU backend, random uniform token prompts): rounds of one forward each. A
// forward records, per MoE layer, every token's bias-channel scalar r_t and the rest of its router
// logits; then each layer's per-expert bias delta_e is fitted on those records alone (top-k recomputed
// for logits + r_t * delta_e; delta_e += step * (log target - log observed) / mean r, step 0.5 then 0.2
// then 0.08, at most 200 iterations, the best iterate kept). Deltas are
// applied through a backend wrapper that adds r_t * delta_e before routing, so no reload is needed; a
// layer's inputs depend only on earlier layers' routing, so from round i on layer i's records no longer
// change; rounds stop once every layer's routing is within 0.01 of its targets (or after max_rounds). The fit reported afterwards is measured on the written checkpoint,
// on fresh prompts.
#include <cstdint>
#include <string>
#include <vector>

#include "eplb/loads.hpp"
#include "model/qwen3_config.hpp"

namespace fulcrum::model {

// Targets [num_moe_layers][num_experts] as inclusion fractions (rows sum to top_k). Throws on mismatch.
eplb::LoadMatrix router_skew_targets(const eplb::LoadMatrix& loads, const Qwen3MoeConfig& config);

struct RouterCalibrationOptions {
  int num_tokens = 4096;   // calibration tokens per round (sequences of `sequence_length`)
  int sequence_length = 64;
  int max_rounds = 6;
  uint64_t seed = 1;
};

struct RouterCalibration {
  std::vector<std::vector<float>> bias;  // [num_moe_layers][num_experts]: delta_e, centred
  int rounds = 0;
  double max_abs_error = 0;  // of the last round's forward, before its refit
};

// `checkpoint_dir` holds a synthetic checkpoint whose router bias column is uniform (no router_bias).
RouterCalibration calibrate_router_bias(const std::string& checkpoint_dir, const Qwen3MoeConfig& config,
                                        const eplb::LoadMatrix& targets, const RouterCalibrationOptions& options);

// Inclusion fractions [num_moe_layers][num_experts] of the checkpoint's routing on random prompts.
eplb::LoadMatrix measure_inclusion(const std::string& checkpoint_dir, const Qwen3MoeConfig& config, int num_tokens,
                                   int sequence_length, uint64_t seed);

struct RouterFit {
  std::vector<double> pearson;        // [num_moe_layers]
  std::vector<double> max_abs_error;  // [num_moe_layers], inclusion fractions
  double pearson_min = 1, pearson_mean = 1, max_abs_error_max = 0;
  std::vector<int> ranks;                      // EP ranks evaluated (those dividing num_experts, of 8/16/32)
  std::vector<double> trivial_balancedness_measured;  // [ranks]: mean over layers, trivial placement
  std::vector<double> trivial_balancedness_target;    // [ranks]
};

RouterFit evaluate_router_fit(const eplb::LoadMatrix& measured, const eplb::LoadMatrix& targets);
std::string router_fit_text(const RouterFit& fit);  // multi-line summary for the CLI

}  // namespace fulcrum::model
