#pragma once
// Pieces both `bench moe` runs share: event timing, the machine's measured ceilings, routing logits drawn
// from a load row, EP balancedness of a map, the Qwen3 MoE shapes, and the JSON document's common fields.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_check.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "bench_moe/moe_bench.hpp"
#include "eplb/dispatch.hpp"

namespace fulcrum::bench_moe {

constexpr int kExperts = kMoeBenchExperts;
constexpr int kTopK = 8;

double median(std::vector<double> v);

// Median of `reps` event-timed runs of fn on `stream` (ms), after `warmup` untimed runs.
template <typename Fn>
double median_ms(cudaStream_t stream, int warmup, int reps, Fn&& fn) {
  cudaEvent_t start, stop;
  FULCRUM_CUDA_CHECK(cudaEventCreate(&start));
  FULCRUM_CUDA_CHECK(cudaEventCreate(&stop));
  for (int r = 0; r < warmup; ++r) fn();
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    FULCRUM_CUDA_CHECK(cudaEventRecord(start, stream));
    fn();
    FULCRUM_CUDA_CHECK(cudaEventRecord(stop, stream));
    FULCRUM_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    FULCRUM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(std::move(times));
}

// Host floats in a new device buffer, landed before this returns (a pageable cudaMemcpy may return before its
// DMA completes, and the layers' non-blocking streams do not wait for the legacy stream).
backend::DeviceBuffer upload(const std::vector<float>& host);

// Ceilings measured on this GPU: {bf16 GEMM FLOP/s (8192^3, fp32 accumulate), copy bytes/s (read + write)}.
std::pair<double, double> measure_ceilings(cudaStream_t stream);

// Logits [T, E] whose top-k is each token's drawn expert set (inclusion probabilities proportional to
// `loads`, systematic sampling without replacement as eplb::TokenSampler): drawn 4 + U(0,1), others U(-1,1).
std::vector<float> logits_for(const std::vector<double>& loads, int64_t tokens, int top_k, uint64_t seed);

// EP balancedness (mean / max rank load) of `loads` under `map` over `ep` ranks, replicas sharing their
// expert's load equally (what the planners assume).
double balancedness(const std::vector<double>& loads, const std::vector<int32_t>& map, int ep);

// What the benchmark routes by, over `ep` ranks: the load row (--loads-layer, or the layer least balanced under
// the trivial placement), the trivial map of E slots, uniform loads, and the fulcrum planner's map of
// E + --redundant slots for the row.
struct LoadRouting {
  int layer_idx = 0;
  std::vector<double> real, uniform;
  std::vector<int32_t> trivial, eplb_map;
  int eplb_slots = 0;
  // "loads FILE layer L: EPn balancedness trivial x, EPLB (P slots) y"
  std::string describe(const MoeBenchOptions& opt, int ep) const;
};
LoadRouting load_routing(const MoeBenchOptions& opt, int ep);

// The draw streams of dynamic replica choice, one per source (empty for the other algorithms).
std::vector<uint64_t> dispatch_streams(eplb::DispatchAlgorithm algorithm, int num_sources);

// The fulcrum planner's map of E + redundant slots over `ep` ranks for `loads`.
std::vector<int32_t> plan_map(const std::vector<double>& loads, int num_slots, int ep);

// One routing scenario of the tables: a layer (with its slot count), a placement map, the loads tokens are
// drawn from, and the replica choice. routing_scenarios lists them in table order.
template <typename Layer>
struct Scenario {
  std::string name;
  Layer* layer = nullptr;
  std::vector<int32_t> map;
  const std::vector<double>* loads = nullptr;
  eplb::DispatchAlgorithm dispatch = eplb::DispatchAlgorithm::kStatic;
};
template <typename Layer>
std::vector<Scenario<Layer>> routing_scenarios(Layer& plain, Layer& balanced, const std::vector<int32_t>& trivial,
                                               const std::vector<int32_t>& eplb_map, const std::vector<double>& uniform,
                                               const std::vector<double>& real) {
  using D = eplb::DispatchAlgorithm;
  return {{"uniform", &plain, trivial, &uniform, D::kStatic},
          {"loads_no_eplb", &plain, trivial, &real, D::kStatic},
          {"loads_eplb_static", &balanced, eplb_map, &real, D::kStatic},
          {"loads_eplb_dynamic", &balanced, eplb_map, &real, D::kDynamic},
          {"loads_eplb_balanced", &balanced, eplb_map, &real, D::kBalanced}};
}

// Device inputs of one model: activations x [T, H] bf16 (pseudo-random from `seed`), out [T, H] fp32, and a
// zeroed recorder row [E]; ready when the constructor returns.
struct LayerInputs {
  LayerInputs(int64_t max_tokens, int hidden, uint64_t seed, cudaStream_t stream);
  backend::DeviceBuffer x, out, histogram;
};

// Machine and run fields of the result document; write_json writes it atomically (no half-written file).
nlohmann::json machine_json(int device);
void write_json(const MoeBenchOptions& opt, nlohmann::json doc);

}  // namespace fulcrum::bench_moe
