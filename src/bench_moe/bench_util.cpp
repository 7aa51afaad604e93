#include "bench_moe/bench_util.hpp"

#include <cmath>
#include <numeric>

#include <cublas_v2.h>

#include "backend/cuda/moe_kernels.hpp"
#include "backend/cuda/moe_layer.hpp"
#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "eplb/loads.hpp"
#include "eplb/planner.hpp"
#include "eplb/token_sampling.hpp"

namespace fulcrum::bench_moe {

using backend::DeviceBuffer;

ModelShape model_shape(const std::string& name) {
  if (name == "qwen3-30b-a3b") return {name, 2048, 768};
  if (name == "qwen3-235b-a22b") return {name, 4096, 1536};
  throw Error(fmt::format("unknown model '{}' (known: qwen3-30b-a3b, qwen3-235b-a22b)", name));
}

void validate(const MoeBenchOptions& opt) {
  FULCRUM_CHECK(!opt.models.empty(), "--models: name at least one model");
  for (const auto& m : opt.models) model_shape(m);
  FULCRUM_CHECK(!opt.tokens.empty(), "--tokens: give at least one batch size");
  for (const int64_t t : opt.tokens) FULCRUM_CHECK(t > 0 && t <= (int64_t{1} << 20), "--tokens {}: must be in [1, 1048576]", t);
  FULCRUM_CHECK(opt.reps > 0 && opt.warmup >= 0, "--reps must be positive and --warmup >= 0");
  FULCRUM_CHECK(opt.gpus >= 1, "--gpus must be at least 1, got {}", opt.gpus);
  FULCRUM_CHECK(opt.ep >= 1 && kExperts % opt.ep == 0 && (kExperts + opt.redundant) % opt.ep == 0,
                "--ep {} with --redundant {}: the EP ranks must divide both 128 experts and 128 + redundant slots",
                opt.ep, opt.redundant);
  FULCRUM_CHECK(opt.passes > 0 && opt.layers_per_pass > 0, "--passes and --layers-per-pass must be positive");
  FULCRUM_CHECK(!opt.loads.empty(), "--loads: a load matrix CSV is required (../shared/data/loads/*.csv)");
  const eplb::LoadMatrix loads = eplb::read_loads_file(opt.loads);
  FULCRUM_CHECK(loads.num_logical_experts == kExperts, "{}: {} experts, the Qwen3 shapes have 128", opt.loads,
                loads.num_logical_experts);
  FULCRUM_CHECK(opt.loads_layer < loads.num_layers, "--loads-layer {} but {} has {} layers", opt.loads_layer, opt.loads,
                loads.num_layers);
}

double median(std::vector<double> v) {
  FULCRUM_CHECK(!v.empty(), "median of no values");
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

std::pair<double, double> measure_ceilings(cudaStream_t stream) {
  const int n = 8192;
  DeviceBuffer a(size_t(2) * n * n), b(size_t(2) * n * n), c(size_t(2) * n * n);
  FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(a.as<uint16_t>(), int64_t(n) * n, 1, 1.0f, stream));
  FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(b.as<uint16_t>(), int64_t(n) * n, 2, 1.0f, stream));
  cublasHandle_t handle;
  FULCRUM_CUBLAS_CHECK(cublasCreate(&handle));
  FULCRUM_CUBLAS_CHECK(cublasSetStream(handle, stream));
  const float alpha = 1, beta = 0;
  const double gemm_ms = median_ms(stream, 3, 10, [&] {
    FULCRUM_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a.as<void>(), CUDA_R_16BF, n,
                                      b.as<void>(), CUDA_R_16BF, n, &beta, c.as<void>(), CUDA_R_16BF, n,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  });
  cublasDestroy(handle);
  const size_t bytes = size_t(4) << 30;
  DeviceBuffer src(bytes), dst(bytes);
  FULCRUM_CUDA_CHECK(cudaMemsetAsync(src.as<void>(), 1, bytes, stream));
  const double copy_ms = median_ms(stream, 2, 10, [&] {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(dst.as<void>(), src.as<void>(), bytes, cudaMemcpyDeviceToDevice, stream));
  });
  return {2.0 * n * n * double(n) / (gemm_ms * 1e-3), 2.0 * bytes / (copy_ms * 1e-3)};
}

std::vector<float> logits_for(const std::vector<double>& loads, int64_t tokens, int top_k, uint64_t seed) {
  const int e = static_cast<int>(loads.size());
  eplb::SplitMix64 rng(seed);
  const std::vector<double> pi = eplb::inclusion_probabilities(loads, top_k);
  const eplb::TokenSampler sampler(pi, top_k, rng);
  std::vector<float> logits(static_cast<size_t>(tokens * e));
  std::vector<int> chosen;
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = logits.data() + t * e;
    for (int x = 0; x < e; ++x) row[x] = static_cast<float>(2.0 * rng.uniform() - 1.0);
    sampler.draw(rng, chosen);
    for (const int x : chosen) row[x] = static_cast<float>(4.0 + rng.uniform());
  }
  return logits;
}

double balancedness(const std::vector<double>& loads, const std::vector<int32_t>& map, int ep) {
  std::vector<int> replicas(loads.size(), 0);
  for (const int32_t e : map) ++replicas[e];
  std::vector<double> rank(static_cast<size_t>(ep), 0.0);
  const int per_rank = static_cast<int>(map.size()) / ep;
  for (size_t s = 0; s < map.size(); ++s) rank[s / per_rank] += loads[map[s]] / replicas[map[s]];
  return std::accumulate(rank.begin(), rank.end(), 0.0) / ep / *std::max_element(rank.begin(), rank.end());
}

std::pair<int, std::vector<double>> pick_load_layer(const MoeBenchOptions& opt, int ep) {
  const eplb::LoadMatrix loads = eplb::read_loads_file(opt.loads);
  std::vector<int32_t> trivial(kExperts);
  std::iota(trivial.begin(), trivial.end(), 0);
  int layer_idx = opt.loads_layer;
  if (layer_idx < 0) {
    double worst = 2;
    for (int l = 0; l < loads.num_layers; ++l) {
      const auto row = loads.layer(l);
      const double b = balancedness({row.begin(), row.end()}, trivial, ep);
      if (b < worst) worst = b, layer_idx = l;
    }
  }
  const auto row = loads.layer(layer_idx);
  return {layer_idx, std::vector<double>(row.begin(), row.end())};
}

std::vector<int32_t> plan_map(const std::vector<double>& loads, int num_slots, int ep) {
  eplb::PlanOptions plan;
  plan.topology = eplb::Topology{num_slots, ep, 1};
  std::vector<int32_t> map(static_cast<size_t>(num_slots));
  eplb::make_planner("fulcrum")->plan_layer(loads, plan, {}, map);
  return map;
}

nlohmann::json machine_json(int device) {
  cudaDeviceProp prop{};
  FULCRUM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int driver = 0, count = 0;
  cudaDriverGetVersion(&driver);
  cudaGetDeviceCount(&count);
  return {{"gpu", prop.name}, {"sms", prop.multiProcessorCount}, {"cuda_driver", driver}, {"visible_gpus", count}};
}

void write_json(const MoeBenchOptions& opt, nlohmann::json doc) {
  if (opt.json_path.empty()) return;
  doc["command"] = opt.command;
  doc["git_commit"] = opt.git_commit;
  doc["reps"] = opt.reps;
  doc["warmup"] = opt.warmup;
  doc["loads"] = opt.loads;
  write_file_atomically(opt.json_path, doc.dump(2) + "\n");
}

}  // namespace fulcrum::bench_moe
