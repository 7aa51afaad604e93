// Trace simulator; the semantics are documented in simulate.hpp.
#include "eplb/simulate.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "eplb/metrics.hpp"
#include "eplb/planner.hpp"
#include "eplb/token_sampling.hpp"

namespace fulcrum::eplb {
namespace {

constexpr double kTokensPerUnitLoad = 1e6;  // expected-loads mode: integer tokens for the balanced splitter

uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b, uint64_t c, uint64_t stream) {
  SplitMix64 rng(seed ^ (a * 0x100000001b3ULL) ^ (b << 20) ^ (c << 40) ^ (stream << 60));
  rng.next();
  return rng.next();
}

// Expected-loads balancedness of one layer.
double expected_layer_balancedness(std::span<const double> expert_load, std::span<const int32_t> layer_map,
                                   const Topology& topo, DispatchAlgorithm dispatch) {
  const int num_experts = static_cast<int>(expert_load.size());
  const int num_gpus = topo.num_gpus;
  std::vector<double> loads(num_gpus, 0.0);
  switch (dispatch) {
    case DispatchAlgorithm::kDynamic:
      loads = gpu_loads(expert_load, layer_map, topo);
      break;
    case DispatchAlgorithm::kStatic: {
      const auto table = build_static_dispatch(layer_map, num_experts, topo);
      for (int src = 0; src < num_gpus; ++src) {
        for (int e = 0; e < num_experts; ++e) loads[topo.gpu_of_slot(table.slot(src, e))] += expert_load[e] / num_gpus;
      }
      break;
    }
    case DispatchAlgorithm::kBalanced: {
      std::vector<int64_t> tokens(static_cast<size_t>(num_gpus) * num_experts, 0);
      for (int e = 0; e < num_experts; ++e) {
        const auto total = static_cast<int64_t>(std::llround(expert_load[e] * kTokensPerUnitLoad));
        for (int i = 0; i < num_gpus; ++i) {
          const int src = (e + i) % num_gpus;
          tokens[static_cast<size_t>(src) * num_experts + e] = total / num_gpus + (i < total % num_gpus ? 1 : 0);
        }
      }
      BalancedSplitter splitter(layer_map, num_experts, topo);
      BalancedDispatch out;
      splitter.split(tokens, out);
      for (int g = 0; g < num_gpus; ++g) loads[g] = static_cast<double>(out.gpu_loads[g]);
      break;
    }
  }
  return balancedness(loads);
}

// Sampled-batches balancedness of one layer: mean over batches.
double batch_layer_balancedness(std::span<const double> expert_load, std::span<const int32_t> layer_map,
                                const SimulateOptions& options, int window_idx, int layer_idx) {
  const Topology& topo = options.topology;
  const int num_experts = static_cast<int>(expert_load.size());
  const int num_gpus = topo.num_gpus;
  const int num_positive = static_cast<int>(std::count_if(expert_load.begin(), expert_load.end(),
                                                          [](double v) { return v > 0.0; }));
  FULCRUM_CHECK(num_positive >= options.top_k,
                "window {} layer {} has {} experts with positive load; sampling top_k = {} distinct needs that many",
                window_idx, layer_idx, num_positive, options.top_k);
  const std::vector<double> pi = inclusion_probabilities(expert_load, options.top_k);
  StaticDispatchTable static_table;
  if (options.dispatch == DispatchAlgorithm::kStatic) static_table = build_static_dispatch(layer_map, num_experts, topo);
  std::optional<BalancedSplitter> splitter;
  if (options.dispatch == DispatchAlgorithm::kBalanced) splitter.emplace(layer_map, num_experts, topo);
  BalancedDispatch out;
  std::vector<int64_t> tokens(static_cast<size_t>(num_gpus) * num_experts);
  std::vector<double> loads(num_gpus);
  std::vector<int> chosen;
  chosen.reserve(options.top_k);
  double sum = 0.0;
  for (int batch_idx = 0; batch_idx < options.batches_per_window; ++batch_idx) {
    SplitMix64 token_rng(mix_seed(options.seed, window_idx, layer_idx, batch_idx, 0));
    const TokenSampler sampler(pi, options.top_k, token_rng);
    std::optional<DynamicDispatcher> dynamic;
    if (options.dispatch == DispatchAlgorithm::kDynamic) {
      dynamic.emplace(layer_map, num_experts, topo, mix_seed(options.seed, window_idx, layer_idx, batch_idx, 1));
    }
    std::fill(tokens.begin(), tokens.end(), 0);
    std::fill(loads.begin(), loads.end(), 0.0);
    for (int64_t token_idx = 0; token_idx < options.batch_tokens; ++token_idx) {
      const int src = static_cast<int>(token_idx % num_gpus);
      sampler.draw(token_rng, chosen);
      for (int e : chosen) {
        if (dynamic) loads[topo.gpu_of_slot(dynamic->pick(e))] += 1.0;
        else ++tokens[static_cast<size_t>(src) * num_experts + e];
      }
    }
    if (options.dispatch == DispatchAlgorithm::kStatic) {
      for (int src = 0; src < num_gpus; ++src) {
        for (int e = 0; e < num_experts; ++e) {
          loads[topo.gpu_of_slot(static_table.slot(src, e))] += tokens[static_cast<size_t>(src) * num_experts + e];
        }
      }
    } else if (splitter) {
      splitter->split(tokens, out);
      for (int g = 0; g < num_gpus; ++g) loads[g] = static_cast<double>(out.gpu_loads[g]);
    }
    sum += balancedness(loads);
  }
  return sum / options.batches_per_window;
}

void validate(const std::vector<LoadMatrix>& windows, const SimulateOptions& options) {
  FULCRUM_CHECK(!windows.empty(), "simulate needs at least one load window");
  const int num_layers = windows[0].num_layers, num_experts = windows[0].num_logical_experts;
  FULCRUM_CHECK(num_layers > 0 && num_experts > 0, "load window 0 is empty ({} layers x {} experts)", num_layers,
                num_experts);
  for (size_t t = 0; t < windows.size(); ++t) {
    const LoadMatrix& w = windows[t];
    FULCRUM_CHECK(w.num_layers == num_layers && w.num_logical_experts == num_experts &&
                      w.values.size() == static_cast<size_t>(num_layers) * num_experts,
                  "load window {} is {} layers x {} experts but window 0 is {} x {}", t, w.num_layers,
                  w.num_logical_experts, num_layers, num_experts);
    for (double v : w.values) FULCRUM_CHECK(std::isfinite(v) && v >= 0.0, "load window {} has load {}, not finite >= 0", t, v);
  }
  options.topology.validate(num_experts, num_layers);
  FULCRUM_CHECK(options.num_groups > 0, "num_groups must be positive, got {}", options.num_groups);
  FULCRUM_CHECK(options.rebalance_every >= 1, "rebalance_every must be >= 1 window, got {}", options.rebalance_every);
  FULCRUM_CHECK(options.batch_tokens >= 0, "batch_tokens must be >= 0 (0 = expected loads), got {}", options.batch_tokens);
  FULCRUM_CHECK(options.batches_per_window >= 1, "batches_per_window must be >= 1, got {}", options.batches_per_window);
  // top_k only shapes sampled batches; expected loads already count every chosen expert.
  FULCRUM_CHECK(options.batch_tokens == 0 || (options.top_k >= 1 && options.top_k <= num_experts),
                "--top-k must be in [1, {}] (the experts), got {}", num_experts, options.top_k);
}

}  // namespace

SimulateResult simulate(const std::vector<LoadMatrix>& windows, const SimulateOptions& options) {
  validate(windows, options);
  const auto planner = make_planner(options.algorithm);
  const int num_layers = windows[0].num_layers, num_experts = windows[0].num_logical_experts;
  const int num_windows = static_cast<int>(windows.size());
  Placement placement = trivial_placement(options.topology, num_layers, num_experts);
  SimulateResult result;
  for (int t = 0; t < num_windows; ++t) {
    if (t > 0 && t % options.rebalance_every == 0) {
      const std::vector<LoadMatrix> recorded(windows.begin() + (t - options.rebalance_every), windows.begin() + t);
      const PlanOptions plan_options{options.topology, options.num_groups, &placement};
      Placement next = planner->plan(sum_loads(recorded), plan_options);
      result.rebalance_windows.push_back(t);
      result.experts_moved.push_back(experts_moved(placement, next));
      placement = std::move(next);
    }
    double sum = 0.0;
    for (int layer_idx = 0; layer_idx < num_layers; ++layer_idx) {
      const auto load = windows[t].layer(layer_idx);
      sum += options.batch_tokens == 0
                 ? expected_layer_balancedness(load, placement.layer(layer_idx), options.topology, options.dispatch)
                 : batch_layer_balancedness(load, placement.layer(layer_idx), options, t, layer_idx);
    }
    result.balancedness_per_window.push_back(sum / num_layers);
  }
  const auto& per_window = result.balancedness_per_window;
  result.balancedness_mean = std::accumulate(per_window.begin(), per_window.end(), 0.0) / num_windows;
  result.balancedness_min = *std::min_element(per_window.begin(), per_window.end());
  return result;
}

}  // namespace fulcrum::eplb
