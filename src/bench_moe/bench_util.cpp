#include "bench_moe/bench_util.hpp"

#include <unistd.h>

#include <cmath>
#include <numeric>

#include <cublas_v2.h>

#include "gpu/moe/moe_kernels.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "eplb/loads.hpp"
#include "eplb/metrics.hpp"
#include "eplb/planner.hpp"
#include "eplb/token_sampling.hpp"

namespace fulcrum::bench_moe {

using backend::DeviceBuffer;

double median(std::vector<double> v) {
  FULCRUM_CHECK(!v.empty(), "median of no values");
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

DeviceBuffer upload(const std::vector<float>& host) {
  DeviceBuffer buf(sizeof(float) * std::max<size_t>(host.size(), 1));
  FULCRUM_CUDA_CHECK(cudaMemcpy(buf.as<float>(), host.data(), sizeof(float) * host.size(), cudaMemcpyHostToDevice));
  FULCRUM_CUDA_CHECK(cudaDeviceSynchronize());
  return buf;
}

LayerInputs::LayerInputs(int64_t max_tokens, int hidden, uint64_t seed, cudaStream_t stream)
    : x(size_t(2) * max_tokens * hidden), out(sizeof(float) * max_tokens * hidden),
      histogram(sizeof(unsigned long long) * kExperts) {
  FULCRUM_CUDA_CHECK(cudaMemsetAsync(histogram.as<void>(), 0, histogram.bytes(), stream));
  FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(x.as<uint16_t>(), max_tokens * hidden, seed, 1.0f, stream));
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream));
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
  return eplb::balancedness(eplb::gpu_loads(loads, map, eplb::Topology{static_cast<int>(map.size()), ep, 1}));
}

LoadRouting load_routing(const MoeBenchOptions& opt, int ep) {
  const eplb::LoadMatrix loads = eplb::read_loads_file(opt.loads);
  LoadRouting r;
  r.trivial.resize(kExperts);
  std::iota(r.trivial.begin(), r.trivial.end(), 0);
  r.uniform.assign(kExperts, 1.0);
  r.layer_idx = opt.loads_layer;
  if (r.layer_idx < 0) {
    double worst = 2;
    for (int l = 0; l < loads.num_layers; ++l) {
      const auto row = loads.layer(l);
      const double b = balancedness({row.begin(), row.end()}, r.trivial, ep);
      if (b < worst) worst = b, r.layer_idx = l;
    }
  }
  const auto row = loads.layer(r.layer_idx);
  r.real.assign(row.begin(), row.end());
  r.eplb_slots = kExperts + opt.redundant;
  r.eplb_map = plan_map(r.real, r.eplb_slots, ep);
  return r;
}

std::string LoadRouting::describe(const MoeBenchOptions& opt, int ep) const {
  return fmt::format("loads {} layer {}: EP{} balancedness trivial {:.3f}, EPLB ({} slots) {:.3f}", opt.loads,
                     layer_idx, ep, balancedness(real, trivial, ep), eplb_slots, balancedness(real, eplb_map, ep));
}

std::vector<uint64_t> dispatch_streams(eplb::DispatchAlgorithm algorithm, int num_sources) {
  std::vector<uint64_t> streams;
  if (algorithm == eplb::DispatchAlgorithm::kDynamic) {
    for (int r = 0; r < num_sources; ++r) streams.push_back(1000 + static_cast<uint64_t>(r));
  }
  return streams;
}

std::vector<int32_t> plan_map(const std::vector<double>& loads, int num_slots, int ep) {
  eplb::PlanOptions plan;
  plan.topology = eplb::Topology{num_slots, ep, 1};
  std::vector<int32_t> map(static_cast<size_t>(num_slots));
  eplb::make_planner("fulcrum")->plan_layer(loads, plan, {}, map);
  return map;
}

void check_visible_gpus(int gpus) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  FULCRUM_CHECK(status == cudaSuccess, "bench moe: no usable CUDA device ({})", cudaGetErrorString(status));
  FULCRUM_CHECK(count >= gpus, "bench moe --gpus {}: this machine shows {} CUDA device(s)", gpus, count);
}

nlohmann::json machine_json(int device) {
  cudaDeviceProp prop{};
  FULCRUM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int driver = 0, count = 0;
  cudaDriverGetVersion(&driver);
  cudaGetDeviceCount(&count);
  return {{"gpu", prop.name}, {"sms", prop.multiProcessorCount}, {"cuda_driver", driver}, {"visible_gpus", count}};
}

// The FULCRUM_* measurement switches set in the environment (gpu/env_switch.hpp, src/gpu/README.md): a figure
// taken under one is not the default path's, so the JSON says so.
static nlohmann::json fulcrum_environment() {
  nlohmann::json env = nlohmann::json::object();
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry(*e);
    const size_t eq = entry.find('=');
    if (entry.rfind("FULCRUM_", 0) == 0 && eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return env;
}

void write_json(const MoeBenchOptions& opt, nlohmann::json doc) {
  if (opt.json_path.empty()) return;
  doc["environment"] = fulcrum_environment();
  doc["command"] = opt.command;
  doc["git_commit"] = opt.git_commit;
  doc["reps"] = opt.reps;
  doc["warmup"] = opt.warmup;
  doc["loads"] = opt.loads;
  write_file_atomically(opt.json_path, doc.dump(2) + "\n");
}

}  // namespace fulcrum::bench_moe
