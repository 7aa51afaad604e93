// `fulcrum bench moe` on one GPU: every physical slot of the layer on this GPU. Per model and batch it times
// (CUDA events, warm-up, median of --reps):
//   layer      forward_from_logits (router kernel, permutation, expert GEMMs as kAuto picks them: CUTLASS
//              without a host sync where it can run, combine) with the recorder on and off, the two
//              interleaved rep by rep; the router GEMM [T, H] x [H, E] is timed on its own (it does not
//              depend on routing)
//   router     the router kernel alone, recorder on and off
//   experts    the expert stage (gate_up GEMM, SwiGLU, down GEMM) over all slots, cuBLAS grouped,
//              per-slot, auto (the layer's default) and CUTLASS, with FLOPs and minimum bytes against the ceilings
//              measured at start
//   EP ranks   the expert stage over each simulated EP rank's slot subset (--ep ranks, P/ep contiguous
//              slots each), one at a time on this GPU; max and mean over ranks
// Routing scenarios: uniform (every token's top-k uniform without replacement), loads without EPLB
// (trivial placement of P = E slots), loads with EPLB (the fulcrum planner's placement of E + --redundant
// slots over --ep ranks; static, dynamic and balanced replica choice from each token's simulated source rank).
// Then, with --torch-peer, PyTorch's grouped_mm MoE on the uniform scenario's routing (torch_peer.hpp).
#include <fmt/format.h>

#include <memory>
#include <numeric>

#include "gpu/moe/moe_layer.hpp"
#include "bench_moe/bench_util.hpp"
#include "bench_moe/torch_peer.hpp"
#include "eplb/dispatch.hpp"
#include "model/moe_reference.hpp"

namespace fulcrum::bench_moe {
namespace {

using backend::DeviceBuffer;
using backend::GpuMoeLayer;
using nlohmann::json;

using LayerScenario = Scenario<GpuMoeLayer>;

// peer_routing (may be null) receives this run's routing for the torch peer: the logits' top-k and the layer's counts.
json run_scenario(const LayerScenario& sc, int64_t tokens, const MoeBenchOptions& opt, const DeviceBuffer& x, DeviceBuffer& out,
                  unsigned long long* histogram, double peak_flops, double peak_bytes, PeerRouting* peer_routing) {
  GpuMoeLayer& layer = *sc.layer;
  const auto& shape = layer.shape();
  const cudaStream_t stream = layer.stream();
  const eplb::Topology topo{shape.num_slots, opt.ep, 1};
  const int64_t per_source = (tokens + opt.ep - 1) / opt.ep;
  layer.set_replica_choice(model::moe::make_replica_choice(sc.dispatch, sc.map, shape.num_experts, topo, per_source,
                                                           dispatch_streams(sc.dispatch, opt.ep)));
  const std::vector<float> host_logits = logits_for(*sc.loads, tokens, shape.num_experts_per_tok, 77 + tokens);
  const DeviceBuffer logits = upload(host_logits);
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
  const double layer_on = median(on), layer_off = median(off);
  layer.set_recorder(histogram);
  const double route_on = median_ms(stream, opt.warmup, opt.reps, [&] { layer.route(lp, tokens); });
  layer.set_recorder(nullptr);
  const double route_off = median_ms(stream, opt.warmup, opt.reps, [&] { layer.route(lp, tokens); });
  layer.route(lp, tokens);
  layer.permute(xp, tokens);
  const std::span<const int32_t> slot_counts = layer.fetch_slot_counts();  // the CUTLASS path reads none back
  if (peer_routing != nullptr) {
    peer_routing->tokens = tokens;
    peer_routing->topk_ids = topk_of_logits(host_logits, tokens, shape.num_experts, shape.num_experts_per_tok);
    peer_routing->expert_counts.assign(slot_counts.begin(), slot_counts.end());
  }
  const int p = shape.num_slots;
  json gemm;
  const auto variant_name = [](backend::ExpertGemm v) {
    return v == backend::ExpertGemm::kGrouped   ? "grouped"
           : v == backend::ExpertGemm::kPerSlot ? "per_slot"
           : v == backend::ExpertGemm::kCutlass ? "cutlass"
                                                : "auto";
  };
  for (const auto variant : {backend::ExpertGemm::kGrouped, backend::ExpertGemm::kPerSlot, backend::ExpertGemm::kAuto,
                             backend::ExpertGemm::kCutlass}) {
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
    for (int s = b; s < e; ++s) rows += slot_counts[s];
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

// The FP8-expert layer (e4m3 weights, 128x128 block scales; MoeLayerShape::fp8_experts) on the uniform routing:
// layer forward (recorder on) with the 1x128 quantization fused into the permutation and as its own pass, and
// the expert stage (the activation quantizations and CUTLASS FP8 grouped GEMMs) under each GEMM config, side by
// side, against the bf16 row `bf16` of the same model and tokens. The headline figures are the layer's defaults.
json run_fp8(GpuMoeLayer& layer, const std::vector<double>& uniform, int64_t tokens, const MoeBenchOptions& opt,
             const DeviceBuffer& x, DeviceBuffer& out, unsigned long long* histogram, const json& bf16, double peak_flops,
             double peak_bytes) {
  const auto& shape = layer.shape();
  const cudaStream_t stream = layer.stream();
  std::vector<int32_t> trivial(static_cast<size_t>(shape.num_slots));
  std::iota(trivial.begin(), trivial.end(), 0);
  layer.set_replica_choice(model::moe::make_replica_choice(eplb::DispatchAlgorithm::kStatic, trivial, shape.num_experts,
                                                           {shape.num_slots, 1, 1}, tokens, {}));
  const DeviceBuffer logits = upload(logits_for(uniform, tokens, shape.num_experts_per_tok, 77 + tokens));
  layer.set_recorder(histogram);
  const bool default_fused = layer.fp8_fused_permute();
  json layer_by_permute;
  for (const bool fused : {false, true}) {
    layer.set_fp8_fused_permute(fused);
    layer_by_permute[fused ? "fused_quantize" : "separate_quantize"] = median_ms(stream, opt.warmup, opt.reps, [&] {
      layer.forward_from_logits(x.as<uint16_t>(), logits.as<float>(), tokens, out.as<float>());
    });
  }
  const double layer_ms = layer_by_permute[default_fused ? "fused_quantize" : "separate_quantize"].get<double>();
  layer.set_fp8_fused_permute(false);  // bf16 permuted rows: run_experts times its quantization too
  layer.route(logits.as<float>(), tokens);
  layer.permute(x.as<uint16_t>(), tokens);
  layer.fetch_slot_counts();
  const gpu::Fp8GroupedGemmConfig default_config = gpu::fp8_grouped_gemm_config_for_rows(tokens * shape.num_experts_per_tok);
  json experts_by_config;
  double experts_ms = 0;
  for (int c = 0; c < gpu::kNumFp8GroupedGemmConfigs; ++c) {
    const auto config = static_cast<gpu::Fp8GroupedGemmConfig>(c);
    layer.set_fp8_gemm_config(config);
    const double ms = median_ms(stream, opt.warmup, opt.reps, [&] { layer.run_experts(0, shape.num_slots); });
    experts_by_config[gpu::fp8_grouped_gemm_config_name(config)] = ms;
    if (config == default_config) experts_ms = ms;
  }
  layer.set_fp8_gemm_config(std::nullopt);
  layer.set_fp8_fused_permute(default_fused);
  const double flops = layer.expert_flops(0, shape.num_slots), bytes = layer.expert_min_bytes(0, shape.num_slots);
  // FP8 tensor-core peak is twice bf16's on Hopper (dense e4m3 wgmma): the ceiling the FP8 GEMMs are held to.
  const double floor_ms = std::max(flops / (2 * peak_flops), bytes / peak_bytes) * 1e3;
  return {{"layer_ms_recorder_on", layer_ms}, {"layer_ms_by_permute", layer_by_permute},
          {"fused_permute_default", default_fused}, {"experts_ms", experts_ms},
          {"experts_ms_by_config", experts_by_config},
          {"default_config", gpu::fp8_grouped_gemm_config_name(default_config)},
          {"experts_tflops", flops / (experts_ms * 1e-3) / 1e12},
          {"experts_roofline_fraction", floor_ms / experts_ms},
          {"experts_bound", flops / (2 * peak_flops) > bytes / peak_bytes ? "tensor-core (2x bf16 peak)" : "HBM"},
          {"layer_speedup_over_bf16", bf16["layer_ms_recorder_on"].get<double>() / layer_ms},
          {"experts_speedup_over_bf16_cutlass", bf16["expert_gemm"]["cutlass"]["ms"].get<double>() / experts_ms}};
}

void report_peer(json& peer, json& results);

// Runs the torch peer on the uniform routing (after the layers freed the GPU), adds layer_vs_torch and
// experts_vs_torch to the uniform rows of `results` and prints them. A failing peer is a note and {"error": ...}.
json run_peer(const std::string& script, const std::vector<PeerRouting>& routing, const MoeBenchOptions& opt, json& results) {
  std::vector<json> models;
  for (const std::string& name : opt.models) {
    const ModelShape m = model_shape(name);
    models.push_back({{"name", m.name}, {"hidden", m.hidden}, {"intermediate", m.intermediate}});
  }
  json peer;
  for (const PeerRouting& r : routing) {  // the host top-k must be what the layer's router chose
    if (expert_counts_of(r.topk_ids, kExperts) != r.expert_counts)
      peer = {{"error", fmt::format("T={}: the logits' top-k gives other expert counts than the layer's router", r.tokens)}};
  }
  if (peer.is_null()) {
    fmt::print("# torch peer: python3 {} on the uniform routing of this run\n", script);
    peer = run_torch_peer(script, peer_routing_json(models, routing, kExperts, kTopK), opt.warmup, opt.reps);
  }
  if (peer.contains("error")) {
    fmt::print("torch peer failed (figures without it): {}\n", peer["error"].get<std::string>());
    return peer;
  }
  try {  // a result of unexpected shape is the peer's failure too, not the benchmark's
    report_peer(peer, results);
  } catch (const std::exception& e) {
    peer = {{"error", fmt::format("{}'s result: {}", script, e.what())}};
    fmt::print("torch peer failed (figures without it): {}\n", peer["error"].get<std::string>());
  }
  return peer;
}

// Adds the ratios to the uniform rows of `results`, prints them, and notes their definition in `peer`.
void report_peer(json& peer, json& results) {
  add_torch_ratios(results, peer);
  const auto ms_or_na = [](const json& row, const char* key) {
    return row.contains(key) && row[key].is_number() ? fmt::format("{:.3f} ms", row[key].get<double>()) : std::string("n/a");
  };
  fmt::print("torch {} on {}: FP8 rowwise {}, FP8 blockwise {}\n", peer.value("torch", "?"), peer.value("device", "?"),
             peer.value("fp8_rowwise", "?"), peer.value("fp8_blockwise", "?"));
  for (const json& r : results) {
    if (!r.contains("layer_vs_torch")) continue;
    const json& p = *torch_peer_row(peer, r["model"].get<std::string>(), r["tokens"].get<int64_t>());
    fmt::print("{:16} T={:6} uniform vs torch: layer {:.3f} ms, torch {:.3f} ms (torch / fulcrum {:.2f}x) | experts cutlass "
               "{:.3f} ms, torch grouped_mm {:.3f} ms ({:.2f}x) | torch FP8 rowwise experts {}, GEMMs only {}\n",
               r["model"].get<std::string>(), r["tokens"].get<int64_t>(), r["layer_ms_recorder_off"].get<double>(),
               p["layer_ms"].get<double>(), r["layer_vs_torch"].get<double>(), r["expert_gemm"]["cutlass"]["ms"].get<double>(),
               p["experts_ms"].get<double>(), r["experts_vs_torch"].get<double>(), ms_or_na(p, "fp8_rowwise_experts_ms"),
               ms_or_na(p, "fp8_rowwise_gemms_ms"));
  }
  peer["ratios"] = "per uniform result: layer_vs_torch = torch layer_ms / layer_ms_recorder_off, experts_vs_torch = "
                   "torch experts_ms / expert_gemm.cutlass.ms";
}

}  // namespace

void run_single_gpu(const MoeBenchOptions& opt) {
  const int device = 0;
  FULCRUM_CUDA_CHECK(cudaSetDevice(device));
  const LoadRouting routing = load_routing(opt, opt.ep);

  cudaStream_t stream;
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto [peak_flops, peak_bytes] = measure_ceilings(stream);
  const json machine = machine_json(device);
  fmt::print("{}: measured ceilings {:.0f} TFLOP/s bf16 GEMM, {:.2f} TB/s copy\n", machine["gpu"].get<std::string>(),
             peak_flops / 1e12, peak_bytes / 1e12);
  fmt::print("{}\n", routing.describe(opt, opt.ep));
  std::string peer_note;
  const std::string peer_script = resolve_torch_peer(opt.torch_peer, &peer_note);
  if (!peer_note.empty()) fmt::print("{}\n", peer_note);
  std::vector<PeerRouting> peer_routing;  // per --tokens entry; the logits do not depend on the model

  json results = json::array();
  const int64_t max_tokens = *std::max_element(opt.tokens.begin(), opt.tokens.end());
  for (const std::string& model_name : opt.models) {
    const ModelShape m = model_shape(model_name);
    backend::MoeLayerShape shape{m.hidden, m.intermediate, kExperts, kTopK, true, kExperts, max_tokens};
    GpuMoeLayer plain(shape);
    shape.num_slots = routing.eplb_slots;
    GpuMoeLayer balanced(shape);
    plain.randomize_weights(5);
    balanced.randomize_weights(5);
    // FP8 experts where the shape has whole 128 blocks (both Qwen3 presets) and CUTLASS runs here.
    std::unique_ptr<GpuMoeLayer> fp8;
    if (m.hidden % 128 == 0 && m.intermediate % 128 == 0 && plain.uses_cutlass()) {
      backend::MoeLayerShape fp8_shape = shape;
      fp8_shape.num_slots = kExperts;
      fp8_shape.fp8_experts = true;
      fp8 = std::make_unique<GpuMoeLayer>(fp8_shape);
      fp8->randomize_weights(5);
    }
    LayerInputs in(max_tokens, m.hidden, 9, stream);
    const auto scenarios = routing_scenarios(plain, balanced, routing.trivial, routing.eplb_map, routing.uniform, routing.real);
    for (const int64_t tokens : opt.tokens) {
      const double router_gemm_ms = median_ms(plain.stream(), opt.warmup, opt.reps, [&] { plain.router_logits(in.x.as<uint16_t>(), tokens); });
      for (const LayerScenario& sc : scenarios) {
        const bool for_peer = !peer_script.empty() && sc.name == "uniform" && &model_name == &opt.models.front();
        json r = run_scenario(sc, tokens, opt, in.x, in.out, in.histogram.as<unsigned long long>(), peak_flops, peak_bytes,
                              for_peer ? &peer_routing.emplace_back() : nullptr);
        r["model"] = m.name;
        r["router_gemm_ms"] = router_gemm_ms;
        const json& g = r["expert_gemm"];
        fmt::print("{:16} T={:6} {:19} P={:3} layer {:8.3f} ms ({:9.0f} tok/s) rec-off {:8.3f} ms ({:+.2f}%) | router "
                   "{:.3f}/{:.3f} ms | experts grouped {:.3f} / per-slot {:.3f} / auto {:.3f} / cutlass {:.3f} ms, auto {:.2f} of {} roofline | EP{} max "
                   "rank {:.3f} ms, time bal {:.3f}, token bal {:.3f}\n",
                   m.name, tokens, sc.name, sc.map.size(), r["layer_ms_recorder_on"].get<double>(),
                   r["tokens_per_s"].get<double>(), r["layer_ms_recorder_off"].get<double>(),
                   100 * r["recorder_overhead_fraction"].get<double>(), r["router_kernel_ms_recorder_on"].get<double>(),
                   r["router_kernel_ms_recorder_off"].get<double>(), g["grouped"]["ms"].get<double>(),
                   g["per_slot"]["ms"].get<double>(), g["auto"]["ms"].get<double>(), g["cutlass"]["ms"].get<double>(),
                   g["auto"]["roofline_fraction"].get<double>(), g["auto"]["bound"].get<std::string>(), opt.ep, r["ep_max_rank_expert_ms"].get<double>(),
                   r["ep_time_balancedness"].get<double>(), r["ep_token_balancedness"].get<double>());
        results.push_back(r);
      }
      if (fp8 != nullptr) {
        json& row = results[results.size() - scenarios.size()];  // this tokens' uniform bf16 row
        row["fp8"] = run_fp8(*fp8, routing.uniform, tokens, opt, in.x, in.out, in.histogram.as<unsigned long long>(), row,
                             peak_flops, peak_bytes);
        const json& f = row["fp8"];
        fmt::print("{:16} T={:6} uniform FP8 experts: layer {:8.3f} ms ({:.2f}x bf16) | experts {:.3f} ms ({:.2f}x bf16 "
                   "cutlass), {:.0f} TFLOP/s, {:.2f} of {} roofline | layer quantize fused {:.3f} / separate {:.3f} ms | "
                   "experts pingpong {:.3f} / cooperative {:.3f} ms\n",
                   m.name, tokens, f["layer_ms_recorder_on"].get<double>(), f["layer_speedup_over_bf16"].get<double>(),
                   f["experts_ms"].get<double>(), f["experts_speedup_over_bf16_cutlass"].get<double>(),
                   f["experts_tflops"].get<double>(), f["experts_roofline_fraction"].get<double>(),
                   f["experts_bound"].get<std::string>(), f["layer_ms_by_permute"]["fused_quantize"].get<double>(),
                   f["layer_ms_by_permute"]["separate_quantize"].get<double>(),
                   f["experts_ms_by_config"]["pingpong_64x128x128"].get<double>(),
                   f["experts_ms_by_config"]["cooperative_128x128x128"].get<double>());
      }
    }
  }
  cudaStreamDestroy(stream);
  const json torch_peer = peer_script.empty() ? json{{"off", peer_note.empty() ? "--torch-peer off" : peer_note}}
                                              : run_peer(peer_script, peer_routing, opt, results);
  write_json(opt, {{"mode", "single_gpu"}, {"machine", machine}, {"torch_peer", torch_peer},
                   {"measured_ceilings", {{"bf16_gemm_tflops", peak_flops / 1e12}, {"copy_tb_per_s", peak_bytes / 1e12}}},
                   {"loads_layer", routing.layer_idx}, {"ep_ranks", opt.ep}, {"eplb_slots", routing.eplb_slots}, {"results", results}});
}

}  // namespace fulcrum::bench_moe
