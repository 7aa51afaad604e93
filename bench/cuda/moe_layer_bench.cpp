// fulcrum_moe_bench: the GPU MoE layer (src/backend/cuda/moe_layer.hpp) on one GPU at the Qwen3-30B-A3B and
// Qwen3-235B-A22B MoE shapes, bf16, random weights. Per model and batch it times (CUDA events, warm-up,
// median of --reps):
//   layer      forward_from_logits (router kernel, permutation with its one host sync, expert GEMMs,
//              combine) with the recorder on and off, the two interleaved rep by rep; the router GEMM
//              [T, H] x [H, E] is timed on its own (it does not depend on routing)
//   router     the router kernel alone, recorder on and off
//   experts    the expert stage (gate_up GEMM, SwiGLU, down GEMM) over all slots, cuBLAS grouped,
//              per-slot and auto (the layer's default), with FLOPs and minimum bytes against the ceilings
//              measured at start
//   EP ranks   the expert stage over each virtual EP rank's slot subset (--ep ranks, P/ep contiguous
//              slots each), one at a time on this GPU; max and mean over ranks
// Routing scenarios: uniform (every token's top-k uniform without replacement), loads without EPLB
// (top-k drawn as eplb::TokenSampler does from one layer of a real load matrix, trivial placement of P = E
// slots), loads with EPLB (the fulcrum planner's placement of E + --redundant slots over --ep ranks,
// static dispatch from each token's virtual source rank; also dynamic and balanced). Tokens get logits that make the
// drawn experts the top-k.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <numeric>
#include <random>

#include <CLI/CLI.hpp>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/moe_kernels.hpp"
#include "backend/cuda/moe_layer.hpp"
#include "eplb/loads.hpp"
#include "eplb/planner.hpp"
#include "eplb/token_sampling.hpp"

namespace fulcrum::bench {
namespace {

using backend::DeviceBuffer;
using backend::GpuMoeLayer;
using nlohmann::json;

struct ModelShape {
  std::string name;
  int hidden, intermediate;
};

struct Options {
  std::vector<std::string> models{"qwen3-30b-a3b", "qwen3-235b-a22b"};
  std::vector<int64_t> tokens{256, 1024, 4096, 16384};
  int reps = 20, warmup = 3, ep = 8, redundant = 8, loads_layer = -1;
  std::string loads, json_path, git_commit = "unknown", command;
};

// Median of `reps` event-timed runs of fn (ms), after `warmup` untimed runs.
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
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// Ceilings measured here: a 8192^3 bf16 cuBLAS GEMM (fp32 accumulate) and a 4 GiB device-to-device copy.
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

// Logits [T, E] whose top-k is each token's drawn expert set: drawn experts 4 + U(0,1), others U(-1,1).
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

// EP balancedness (mean / max rank load) of a layer's loads under a map over `ep` ranks, replicas sharing
// their expert's load equally (what the planners assume).
double balancedness(const std::vector<double>& loads, const std::vector<int32_t>& map, int ep) {
  std::vector<int> replicas(loads.size(), 0);
  for (const int32_t e : map) ++replicas[e];
  std::vector<double> rank(static_cast<size_t>(ep), 0.0);
  const int per_rank = static_cast<int>(map.size()) / ep;
  for (size_t s = 0; s < map.size(); ++s) rank[s / per_rank] += loads[map[s]] / replicas[map[s]];
  return std::accumulate(rank.begin(), rank.end(), 0.0) / ep / *std::max_element(rank.begin(), rank.end());
}

struct Scenario {
  std::string name;
  GpuMoeLayer* layer;
  std::vector<int32_t> map;
  const std::vector<double>* loads;
  eplb::DispatchAlgorithm dispatch;
};

json run_scenario(const Scenario& sc, int64_t tokens, const Options& opt, const DeviceBuffer& x, DeviceBuffer& out,
                  unsigned long long* histogram, double peak_flops, double peak_bytes) {
  GpuMoeLayer& layer = *sc.layer;
  const auto& shape = layer.shape();
  const cudaStream_t stream = layer.stream();
  std::vector<uint64_t> streams;
  for (int r = 0; r < opt.ep; ++r) streams.push_back(1000 + r);
  const eplb::Topology topo{shape.num_slots, opt.ep, 1};
  const int64_t per_source = (tokens + opt.ep - 1) / opt.ep;
  layer.set_replica_choice(model::moe::make_replica_choice(sc.dispatch, sc.map, shape.num_experts, topo, per_source,
                                                           sc.dispatch == eplb::DispatchAlgorithm::kDynamic ? streams
                                                                                                            : std::vector<uint64_t>{}));
  const std::vector<float> host_logits = logits_for(*sc.loads, tokens, shape.num_experts_per_tok, 77 + tokens);
  DeviceBuffer logits(sizeof(float) * host_logits.size());
  FULCRUM_CUDA_CHECK(cudaMemcpy(logits.as<float>(), host_logits.data(), sizeof(float) * host_logits.size(), cudaMemcpyHostToDevice));
  const uint16_t* xp = x.as<uint16_t>();
  const float* lp = logits.as<float>();

  // Layer with the recorder on and off, interleaved so clock drift hits both alike.
  std::vector<double> on, off;
  for (int r = 0; r < opt.warmup + opt.reps; ++r) {
    for (const bool record : {true, false}) {
      layer.set_recorder(record ? histogram : nullptr);
      const double ms = median_ms(stream, 0, 1, [&] { layer.forward_from_logits(xp, lp, tokens, out.as<float>()); });
      if (r >= opt.warmup) (record ? on : off).push_back(ms);
    }
  }
  const auto median = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  const double layer_on = median(on), layer_off = median(off);
  layer.set_recorder(histogram);
  const double route_on = median_ms(stream, opt.warmup, opt.reps, [&] { layer.route(lp, tokens); });
  layer.set_recorder(nullptr);
  const double route_off = median_ms(stream, opt.warmup, opt.reps, [&] { layer.route(lp, tokens); });
  layer.route(lp, tokens);
  layer.permute(xp, tokens);
  const int p = shape.num_slots;
  json gemm;
  const auto variant_name = [](backend::ExpertGemm v) {
    return v == backend::ExpertGemm::kGrouped ? "grouped" : v == backend::ExpertGemm::kPerSlot ? "per_slot" : "auto";
  };
  for (const auto variant : {backend::ExpertGemm::kGrouped, backend::ExpertGemm::kPerSlot, backend::ExpertGemm::kAuto}) {
    layer.set_expert_gemm(variant);
    const double ms = median_ms(stream, opt.warmup, opt.reps, [&] { layer.run_experts(0, p); });
    const double flops = layer.expert_flops(0, p), bytes = layer.expert_min_bytes(0, p);
    const double floor_ms = std::max(flops / peak_flops, bytes / peak_bytes) * 1e3;
    gemm[variant_name(variant)] = {
        {"ms", ms}, {"tflops", flops / (ms * 1e-3) / 1e12}, {"gbytes_per_s_min_bytes", bytes / (ms * 1e-3) / 1e9},
        {"bound", flops / peak_flops > bytes / peak_bytes ? "tensor-core" : "HBM"}, {"roofline_fraction", floor_ms / ms}};
  }
  layer.set_expert_gemm(backend::ExpertGemm::kAuto);  // as the layer runs
  std::vector<double> rank_ms;
  std::vector<int64_t> rank_tokens;
  for (int r = 0; r < opt.ep; ++r) {
    const int b = r * p / opt.ep, e = (r + 1) * p / opt.ep;
    rank_ms.push_back(median_ms(stream, opt.warmup, opt.reps, [&] { layer.run_experts(b, e); }));
    int64_t rows = 0;
    for (int s = b; s < e; ++s) rows += layer.slot_counts()[s];
    rank_tokens.push_back(rows);
  }
  const double rank_max = *std::max_element(rank_ms.begin(), rank_ms.end());
  const double rank_mean = std::accumulate(rank_ms.begin(), rank_ms.end(), 0.0) / opt.ep;
  const double tok_max = double(*std::max_element(rank_tokens.begin(), rank_tokens.end()));
  const double tok_mean = std::accumulate(rank_tokens.begin(), rank_tokens.end(), 0.0) / opt.ep;
  return {{"scenario", sc.name}, {"num_slots", p}, {"dispatch", std::string(eplb::to_string(sc.dispatch))},
          {"tokens", tokens}, {"layer_ms_recorder_on", layer_on}, {"layer_ms_recorder_off", layer_off},
          {"tokens_per_s", tokens / (layer_on * 1e-3)}, {"recorder_overhead_fraction", (layer_on - layer_off) / layer_off},
          {"router_kernel_ms_recorder_on", route_on}, {"router_kernel_ms_recorder_off", route_off},
          {"expert_gemm", gemm}, {"ep_rank_expert_ms", rank_ms}, {"ep_rank_rows", rank_tokens},
          {"ep_max_rank_expert_ms", rank_max}, {"ep_time_balancedness", rank_mean / rank_max},
          {"ep_token_balancedness", tok_mean / tok_max}};
}

int run(const Options& opt) {
  int device = 0;
  FULCRUM_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop{};
  FULCRUM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int driver = 0;
  cudaDriverGetVersion(&driver);
  const eplb::LoadMatrix loads = eplb::read_loads_file(opt.loads);
  FULCRUM_CHECK(loads.num_logical_experts == 128, "{}: {} experts, the Qwen3 shapes have 128", opt.loads,
                loads.num_logical_experts);
  const int experts = 128, top_k = 8;
  // The layer whose trivial placement is least balanced over the EP ranks, unless one is named.
  std::vector<int32_t> trivial(experts);
  std::iota(trivial.begin(), trivial.end(), 0);
  int layer_idx = opt.loads_layer;
  if (layer_idx < 0) {
    double worst = 2;
    for (int l = 0; l < loads.num_layers; ++l) {
      const auto row = loads.layer(l);
      const double b = balancedness({row.begin(), row.end()}, trivial, opt.ep);
      if (b < worst) worst = b, layer_idx = l;
    }
  }
  FULCRUM_CHECK(layer_idx < loads.num_layers, "--loads-layer {} but {} has {} layers", layer_idx, opt.loads, loads.num_layers);
  const auto row = loads.layer(layer_idx);
  const std::vector<double> real(row.begin(), row.end()), uniform(experts, 1.0);
  const int p_eplb = experts + opt.redundant;
  eplb::PlanOptions plan;
  plan.topology = eplb::Topology{p_eplb, opt.ep, 1};
  std::vector<int32_t> eplb_map(static_cast<size_t>(p_eplb));
  eplb::make_planner("fulcrum")->plan_layer(real, plan, {}, eplb_map);

  cudaStream_t stream;
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto [peak_flops, peak_bytes] = measure_ceilings(stream);
  fmt::print("{}: measured ceilings {:.0f} TFLOP/s bf16 GEMM, {:.2f} TB/s copy\n", prop.name, peak_flops / 1e12,
             peak_bytes / 1e12);
  fmt::print("loads {} layer {}: EP{} balancedness trivial {:.3f}, EPLB ({} slots) {:.3f}\n", opt.loads, layer_idx,
             opt.ep, balancedness(real, trivial, opt.ep), p_eplb, balancedness(real, eplb_map, opt.ep));

  json results = json::array();
  const int64_t max_tokens = *std::max_element(opt.tokens.begin(), opt.tokens.end());
  for (const std::string& model_name : opt.models) {
    FULCRUM_CHECK(model_name == "qwen3-30b-a3b" || model_name == "qwen3-235b-a22b",
                  "unknown model '{}' (known: qwen3-30b-a3b, qwen3-235b-a22b)", model_name);
    const ModelShape m = model_name == "qwen3-30b-a3b" ? ModelShape{model_name, 2048, 768} : ModelShape{model_name, 4096, 1536};
    backend::MoeLayerShape shape{m.hidden, m.intermediate, experts, top_k, true, experts, max_tokens};
    GpuMoeLayer plain(shape);
    shape.num_slots = p_eplb;
    GpuMoeLayer balanced(shape);
    plain.randomize_weights(5);
    balanced.randomize_weights(5);
    DeviceBuffer x(size_t(2) * max_tokens * m.hidden), out(sizeof(float) * max_tokens * m.hidden);
    DeviceBuffer histogram(sizeof(unsigned long long) * experts);
    FULCRUM_CUDA_CHECK(cudaMemset(histogram.as<void>(), 0, histogram.bytes()));
    FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(x.as<uint16_t>(), max_tokens * m.hidden, 9, 1.0f, stream));
    FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<Scenario> scenarios{
        {"uniform", &plain, trivial, &uniform, eplb::DispatchAlgorithm::kStatic},
        {"loads_no_eplb", &plain, trivial, &real, eplb::DispatchAlgorithm::kStatic},
        {"loads_eplb_static", &balanced, eplb_map, &real, eplb::DispatchAlgorithm::kStatic},
        {"loads_eplb_dynamic", &balanced, eplb_map, &real, eplb::DispatchAlgorithm::kDynamic},
        {"loads_eplb_balanced", &balanced, eplb_map, &real, eplb::DispatchAlgorithm::kBalanced}};
    for (const int64_t tokens : opt.tokens) {
      const double router_gemm_ms = median_ms(plain.stream(), opt.warmup, opt.reps, [&] { plain.router_logits(x.as<uint16_t>(), tokens); });
      for (const Scenario& sc : scenarios) {
        json r = run_scenario(sc, tokens, opt, x, out, histogram.as<unsigned long long>(), peak_flops, peak_bytes);
        r["model"] = m.name;
        r["router_gemm_ms"] = router_gemm_ms;
        const json& g = r["expert_gemm"];
        fmt::print("{:16} T={:6} {:19} P={:3} layer {:8.3f} ms ({:9.0f} tok/s) rec-off {:8.3f} ms ({:+.2f}%) | router "
                   "{:.3f}/{:.3f} ms | experts grouped {:.3f} / per-slot {:.3f} / auto {:.3f} ms, auto {:.2f} of {} roofline | EP{} max "
                   "rank {:.3f} ms, time bal {:.3f}, token bal {:.3f}\n",
                   m.name, tokens, sc.name, sc.map.size(), r["layer_ms_recorder_on"].get<double>(),
                   r["tokens_per_s"].get<double>(), r["layer_ms_recorder_off"].get<double>(),
                   100 * r["recorder_overhead_fraction"].get<double>(), r["router_kernel_ms_recorder_on"].get<double>(),
                   r["router_kernel_ms_recorder_off"].get<double>(), g["grouped"]["ms"].get<double>(),
                   g["per_slot"]["ms"].get<double>(), g["auto"]["ms"].get<double>(),
                   g["auto"]["roofline_fraction"].get<double>(), g["auto"]["bound"].get<std::string>(), opt.ep, r["ep_max_rank_expert_ms"].get<double>(),
                   r["ep_time_balancedness"].get<double>(), r["ep_token_balancedness"].get<double>());
        results.push_back(r);
      }
    }
  }
  if (!opt.json_path.empty()) {
    const json doc{{"command", opt.command}, {"git_commit", opt.git_commit},
                   {"machine", {{"gpu", prop.name}, {"sms", prop.multiProcessorCount}, {"cuda_driver", driver}}},
                   {"measured_ceilings", {{"bf16_gemm_tflops", peak_flops / 1e12}, {"copy_tb_per_s", peak_bytes / 1e12}}},
                   {"loads", opt.loads}, {"loads_layer", layer_idx}, {"ep_ranks", opt.ep}, {"eplb_slots", p_eplb},
                   {"reps", opt.reps}, {"warmup", opt.warmup}, {"results", results}};
    std::ofstream file(opt.json_path + ".tmp");
    file << doc.dump(2) << "\n";
    file.close();
    FULCRUM_CHECK(file.good(), "cannot write {}", opt.json_path);
    std::rename((opt.json_path + ".tmp").c_str(), opt.json_path.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace fulcrum::bench

int main(int argc, char** argv) {
  fulcrum::bench::Options opt;
  CLI::App app{"GPU MoE layer benchmark (one GPU)"};
  app.add_option("--models", opt.models, "qwen3-30b-a3b and/or qwen3-235b-a22b");
  app.add_option("--tokens", opt.tokens, "batch sizes (tokens per forward)");
  app.add_option("--reps", opt.reps)->check(CLI::Range(1, 10000));
  app.add_option("--warmup", opt.warmup)->check(CLI::Range(0, 1000));
  app.add_option("--ep", opt.ep, "virtual EP ranks")->check(CLI::Range(1, 128));
  app.add_option("--redundant", opt.redundant, "EPLB redundant slots")->check(CLI::Range(0, 1024));
  app.add_option("--loads", opt.loads, "load matrix CSV")->required();
  app.add_option("--loads-layer", opt.loads_layer, "layer of the load matrix (default: least balanced)");
  app.add_option("--json", opt.json_path, "write results JSON here");
  app.add_option("--git-commit", opt.git_commit);
  CLI11_PARSE(app, argc, argv);
  for (int i = 0; i < argc; ++i) opt.command += (i ? " " : "") + std::string(argv[i]);
  try {
    return fulcrum::bench::run(opt);
  } catch (const std::exception& e) {
    fmt::print(stderr, "fulcrum_moe_bench: error: {}\n", e.what());
    return 1;
  }
}
