// Planner timings on the Qwen3-235B shape: 94 layers x 128 experts -> 192 slots on 32 GPUs, one core.
// Loads: the qwen3_235b_ep32_r64 golden case's `weight`. Targets (read the medians of
//   --benchmark_repetitions=5 --benchmark_report_aggregates_only=true):
//   BM_FulcrumPlan <= 2 ms, BM_DeepSeekPlan <= 1 ms; the replan has no target (reported for reference).
// Each benchmark's label states its target; counters report the plan's mean balancedness and moves.
#include <benchmark/benchmark.h>

#include <nlohmann/json.hpp>

#include "eplb/loads.hpp"
#include "eplb/metrics.hpp"
#include "eplb/planner.hpp"

namespace fulcrum::eplb {
namespace {

const std::string kSharedDir = FULCRUM_SHARED_DIR;

const LoadMatrix& qwen3_235b_loads() {
  static const LoadMatrix loads = [] {
    const std::string path = kSharedDir + "/golden/deepseek_eplb/qwen3_235b_ep32_r64.json";
    const auto doc = nlohmann::json::parse(read_text_file(path));
    return parse_loads_json(nlohmann::json{{"logical_count", doc["weight"]}}.dump(), path);
  }();
  return loads;
}

// A real 48-layer workload tiled to 94 layers: the "previous" loads of the replan benchmark.
const LoadMatrix& tiled_previous_loads() {
  static const LoadMatrix loads = [] {
    const LoadMatrix real = read_loads_file(kSharedDir + "/data/loads/qwen3-30b-a3b_prefill_gsm8k_en.csv");
    LoadMatrix tiled(94, real.num_logical_experts);
    for (int l = 0; l < 94; ++l) {
      auto src = real.layer(l % real.num_layers);
      std::copy(src.begin(), src.end(), tiled.layer(l).begin());
    }
    return tiled;
  }();
  return loads;
}

PlanOptions shape_options() {
  PlanOptions options;
  options.topology = {192, 32, 1};
  return options;
}

void run_plan(benchmark::State& state, const char* planner_name, double target_ms) {
  const auto planner = make_planner(planner_name);
  const LoadMatrix& loads = qwen3_235b_loads();
  const PlanOptions options = shape_options();
  Placement placement;
  for (auto _ : state) {
    placement = planner->plan(loads, options);
    benchmark::DoNotOptimize(placement.physical_to_logical_map.data());
  }
  state.counters["balancedness"] = evaluate_placement(placement, loads).balancedness_mean;
  state.counters["target_ms"] = target_ms;
  state.SetLabel(fmt::format("target: median <= {} ms", target_ms));
}

void BM_FulcrumPlan(benchmark::State& state) { run_plan(state, "fulcrum", 2.0); }
void BM_DeepSeekPlan(benchmark::State& state) { run_plan(state, "deepseek", 1.0); }

// Migration-aware replan: current = fulcrum plan of the tiled gsm8k_en loads; new loads = the 235B case.
void BM_FulcrumReplan(benchmark::State& state) {
  const auto planner = make_planner("fulcrum");
  const LoadMatrix& loads = qwen3_235b_loads();
  PlanOptions options = shape_options();
  const Placement current = planner->plan(tiled_previous_loads(), options);
  options.current = &current;
  Placement placement;
  for (auto _ : state) {
    placement = planner->plan(loads, options);
    benchmark::DoNotOptimize(placement.physical_to_logical_map.data());
  }
  const Placement fresh = make_planner("deepseek")->plan(loads, shape_options());
  state.counters["balancedness"] = evaluate_placement(placement, loads).balancedness_mean;
  state.counters["moves"] = static_cast<double>(experts_moved(current, placement));
  state.counters["deepseek_moves"] = static_cast<double>(experts_moved(current, fresh));
  state.SetLabel("no timing target");
}

BENCHMARK(BM_FulcrumPlan)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DeepSeekPlan)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FulcrumReplan)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace fulcrum::eplb
