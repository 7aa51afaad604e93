// Dispatch and simulator cost. Run with:
//   fulcrum_bench --benchmark_filter='Dispatch|Simulate' --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
// Layer shape: 128 logical experts, 32 GPUs, 192 slots, placed by the deepseek planner on a real layer.
#include <benchmark/benchmark.h>

#include <string>

#include "eplb/dispatch.hpp"
#include "eplb/planner.hpp"
#include "eplb/simulate.hpp"

namespace fulcrum::eplb {
namespace {

const std::string kLoadsDir = std::string(FULCRUM_SHARED_DIR) + "/data/loads/";

struct LayerFixture {
  Topology topo{192, 32, 1};
  LoadMatrix loads = read_loads_file(kLoadsDir + "qwen3-30b-a3b_prefill_gsm8k_en.csv");
  Placement placement = make_planner("deepseek")->plan(loads, PlanOptions{topo, 1, nullptr});
  int layer_idx = 20;

  // A batch of `num_tokens` x top-8 drawn from a different dataset's loads (the plan is stale, as in serving).
  std::vector<int64_t> batch(int64_t num_tokens) const {
    const LoadMatrix other = read_loads_file(kLoadsDir + "qwen3-30b-a3b_prefill_mmlu_he.csv");
    const auto w = other.layer(layer_idx);
    std::vector<int64_t> tokens(static_cast<size_t>(topo.num_gpus) * loads.num_logical_experts, 0);
    SplitMix64 rng(7);
    const double total = 8.0;
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int src = static_cast<int>(t % topo.num_gpus);
      for (int k = 0; k < 8; ++k) {  // independent draws are enough for a timing input
        double target = rng.uniform() * total;
        int e = 0;
        while (e + 1 < static_cast<int>(w.size()) && (target -= w[e]) >= 0.0) ++e;
        ++tokens[static_cast<size_t>(src) * loads.num_logical_experts + e];
      }
    }
    return tokens;
  }
};

void BM_DispatchBalancedSplit(benchmark::State& state) {
  const LayerFixture f;
  const auto tokens = f.batch(state.range(0));
  BalancedSplitter splitter(f.placement.layer(f.layer_idx), f.loads.num_logical_experts, f.topo);
  BalancedDispatch out;
  for (auto _ : state) {
    splitter.split(tokens, out);
    benchmark::DoNotOptimize(out.max_gpu_load);
  }
  state.SetLabel("us per layer");
}
BENCHMARK(BM_DispatchBalancedSplit)->Arg(4096)->Arg(16384)->Unit(benchmark::kMicrosecond);

void BM_DispatchBalancedBuildAndSplit(benchmark::State& state) {
  const LayerFixture f;
  const auto tokens = f.batch(state.range(0));
  BalancedDispatch out;
  for (auto _ : state) {
    BalancedSplitter splitter(f.placement.layer(f.layer_idx), f.loads.num_logical_experts, f.topo);
    splitter.split(tokens, out);
    benchmark::DoNotOptimize(out.max_gpu_load);
  }
}
BENCHMARK(BM_DispatchBalancedBuildAndSplit)->Arg(4096)->Arg(16384)->Unit(benchmark::kMicrosecond);

void BM_DispatchStaticTable(benchmark::State& state) {
  const LayerFixture f;
  for (auto _ : state) {
    auto table = build_static_dispatch(f.placement.layer(f.layer_idx), f.loads.num_logical_experts, f.topo);
    benchmark::DoNotOptimize(table.slot_of.data());
  }
}
BENCHMARK(BM_DispatchStaticTable)->Unit(benchmark::kMicrosecond);

// 12 real windows, 48 layers, rebalance every window, deepseek planner; arg = batch tokens (0 = expected).
void BM_Simulate(benchmark::State& state) {
  std::vector<LoadMatrix> windows;
  for (const char* name : {"arc_en", "arc_he", "copa_en", "copa_he", "gsm8k_en", "gsm8k_he", "mmlu_en", "mmlu_he",
                           "nli_en", "nli_he", "ted_en", "ted_he"}) {
    windows.push_back(read_loads_file(kLoadsDir + "qwen3-30b-a3b_prefill_" + name + ".csv"));
  }
  SimulateOptions options;
  options.topology = {192, 32, 1};
  options.algorithm = "deepseek";
  options.dispatch = static_cast<DispatchAlgorithm>(state.range(1));
  options.batch_tokens = state.range(0);
  for (auto _ : state) {
    const auto result = simulate(windows, options);
    benchmark::DoNotOptimize(result.balancedness_mean);
  }
}
BENCHMARK(BM_Simulate)
    ->ArgsProduct({{0, 4096}, {0, 1, 2}})
    ->ArgNames({"batch_tokens", "dispatch"})
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace fulcrum::eplb
