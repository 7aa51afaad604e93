// `fulcrum bench generate`: the GPU engine on the full Qwen3-MoE shapes with random bf16 weights generated on
// the device: decode ms/step per (batch, context), prefill tokens/s, each beside its roofline measured in the
// same run (decode: the bytes the step must read over the measured copy bandwidth; prefill: FLOPs over the
// measured bf16 GEMM rate) and, with --peer, HF transformers on the same shape (bench/peer/hf_decode_peer.py).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_check.hpp"
#include "bench_moe/bench_util.hpp"
#include "cli/commands.hpp"
#include "cli/gpu_commands.hpp"
#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "eplb/json_text.hpp"
#include "gpu/device_weights.hpp"
#include "gpu/gpu_engine.hpp"
#include "model/rng.hpp"
#include "model/synthetic_model.hpp"

namespace fulcrum::cli {
namespace {

struct BenchGenerateOptions {
  std::string preset = "qwen3-30b-a3b";
  int layers = 0;  // 0: the preset's
  bool fp8 = false;  // the preset as its FP8 checkpoint: experts FP8 on the device
  bool fp8_dense_gemms = false;  // and the dense projections too (GpuEngineOptions::fp8_dense_gemms)
  std::vector<int> batches = {1, 4, 16, 64, 256};
  std::vector<int> contexts = {512, 2048};
  std::vector<std::string> prefills = {"1x2048", "8x2048", "1x16384"};
  int steps = 32;
  int warmup = 4;
  int prefill_reps = 3;
  std::string attention = "auto";
  int64_t skinny_max_entries = backend::kDefaultSkinnyMaxEntries;
  std::string peer_script;  // empty: no peer
  std::vector<int> peer_batches = {1, 16, 64};
  int peer_context = 512;
  std::string json_path;
  std::string git_commit;
  bool profile = false;
  bool cuda_graphs = true;  // cudaProfilerStart/Stop around the timed decode steps (ncu --profile-from-start off)
};

struct Prefill {
  int seqs = 0;
  int len = 0;
};

Prefill parse_prefill(const std::string& text) {
  const size_t x = text.find('x');
  FULCRUM_CHECK(x != std::string::npos, "--prefill '{}': expected SEQSxTOKENS, e.g. 8x2048", text);
  const Prefill p{std::atoi(text.substr(0, x).c_str()), std::atoi(text.substr(x + 1).c_str())};
  FULCRUM_CHECK(p.seqs >= 1 && p.len >= 1, "--prefill '{}': expected SEQSxTOKENS, e.g. 8x2048", text);
  return p;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Bytes a decode step of `batch` sequences at `context` must read: every non-expert weight (attention, norms,
// routers, LM head), the experts its tokens touch, the embedding rows, and the KV of every sequence.
double decode_bytes(const model::Qwen3MoeConfig& c, bool fp8_dense_gemms, int batch, int64_t context,
                    int64_t distinct_experts) {
  const double h = c.hidden_size, d = c.head_dim, hq = c.num_attention_heads, hkv = c.num_key_value_heads;
  // Dense projections kept FP8 (DeviceWeights::fp8_dense_for) read 1 byte per weight plus a 4-byte scale per
  // 128 x 128 block; everything else is bf16 (2 bytes, counted in elems).
  const gpu::DeviceWeights::Fp8Dense fp8 = gpu::DeviceWeights::fp8_dense_for(c, fp8_dense_gemms);
  const auto fp8_bytes = [](double rows, double cols) { return rows * cols * (1.0 + 4.0 / (128.0 * 128.0)); };
  double elems = 0, fp8_dense_bytes = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    elems += 2 * h + 2 * d;
    const double qkv = (hq + 2 * hkv) * d, o = hq * d;
    if (fp8.qkv) fp8_dense_bytes += fp8_bytes(qkv, h); else elems += qkv * h;
    if (fp8.o) fp8_dense_bytes += fp8_bytes(h, o); else elems += h * o;
    if (c.is_moe_layer(l)) {
      elems += double(c.num_experts) * h;
    } else if (fp8.mlp) {
      fp8_dense_bytes += fp8_bytes(3.0 * c.intermediate_size, h);
    } else {
      elems += 3.0 * c.intermediate_size * h;
    }
  }
  elems += double(c.vocab_size) * h + h + batch * h;                    // LM head, final norm, embedding rows
  elems += double(batch) * double(context + 1) * c.num_hidden_layers * 2 * hkv * d;  // KV read
  // Experts touched, over all layers: bf16, or FP8 codes and their block scales as the slot pool holds them.
  const int64_t i = gpu::DeviceWeights::expert_intermediate_for(c);
  const double expert_bytes = gpu::DeviceWeights::fp8_experts_for(c)
                                  ? double(backend::fp8_blob_bytes(2 * i, c.hidden_size) + backend::fp8_blob_bytes(c.hidden_size, i))
                                  : 2.0 * 3.0 * double(i) * h;
  return 2 * elems + fp8_dense_bytes + double(distinct_experts) * expert_bytes;
}

// FLOPs of a prefill of `seqs` x `len` tokens: every token through the projections, router, its k experts or
// the dense MLP; causal attention; the LM head for the one row per sequence that samples.
double prefill_flops(const model::Qwen3MoeConfig& c, int seqs, int64_t len) {
  const double h = c.hidden_size, d = c.head_dim, hq = c.num_attention_heads, hkv = c.num_key_value_heads;
  double per_token = 0, attn = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    per_token += 2 * ((hq + 2 * hkv) * d * h + h * hq * d);
    per_token += c.is_moe_layer(l) ? 2 * (double(c.num_experts) * h + c.num_experts_per_tok * 3.0 * c.moe_intermediate_size * h)
                                   : 2 * 3.0 * c.intermediate_size * h;
    attn += 4.0 * hq * d * double(len) * double(len + 1) / 2;  // QK^T and PV over the causal triangle
  }
  return seqs * (per_token * double(len) + attn + 2.0 * c.vocab_size * h);
}

void run_bench_generate(const BenchGenerateOptions& o) {
  FULCRUM_CHECK(o.steps >= 1 && o.warmup >= 0 && o.prefill_reps >= 1, "--steps, --warmup, --prefill-reps");
  std::vector<Prefill> prefills;
  for (const std::string& p : o.prefills) {
    if (p != "none") prefills.push_back(parse_prefill(p));
  }
  model::PresetOverrides overrides;
  overrides.num_hidden_layers = o.layers;
  const nlohmann::json config_json = model::preset_config_json(o.preset, overrides);
  model::Qwen3MoeConfig config = model::parse_qwen3_moe_config(config_json, o.preset);
  if (o.fp8) config.quantization = model::Fp8BlockQuantization{};  // random FP8 experts (DeviceWeights::fill_random)

  gpu::GpuEngineOptions eo;
  eo.attention = o.attention;
  eo.cuda_graphs = o.cuda_graphs;
  eo.skinny_max_entries = o.skinny_max_entries;
  eo.fp8_dense_gemms = o.fp8_dense_gemms;
  FULCRUM_CHECK(o.fp8 || !o.fp8_dense_gemms, "--fp8-dense-gemms needs --fp8 (a bf16 model has no FP8 projections)");
  int max_seqs = 1;
  int64_t max_tokens = 1, positions = 1;
  for (const int b : o.batches) {
    max_seqs = std::max(max_seqs, b);
    for (const int c : o.contexts) positions = std::max<int64_t>(positions, int64_t{b} * (c + o.steps + o.warmup + 2 + 16));
  }
  for (const Prefill& p : prefills) {
    max_seqs = std::max(max_seqs, p.seqs);
    max_tokens = std::max<int64_t>(max_tokens, int64_t{p.seqs} * p.len);
    positions = std::max<int64_t>(positions, int64_t{p.seqs} * (p.len + 16));
  }
  eo.max_batch_seqs = max_seqs;
  eo.max_batch_tokens = std::max<int64_t>(max_tokens, max_seqs);
  eo.kv_pages = positions / eo.page_size + max_seqs;
  eo.time_steps = true;  // device times beside each decode figure
  nlohmann::json runs = nlohmann::json::array();
  nlohmann::json machine = bench_moe::machine_json(0);
  double gemm_flops = 0, copy_bytes = 0;
  {
    gpu::GpuEngine engine(config, eo);
    engine.fill_random(0x5eed);
    engine.fill_kv_random(0xcafe);
    cudaStream_t stream = nullptr;
    FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::tie(gemm_flops, copy_bytes) = bench_moe::measure_ceilings(stream);
    cudaStreamDestroy(stream);
    fmt::print("# {} ({} layers), attention {}: measured ceilings {:.0f} TFLOP/s bf16 GEMM, {:.0f} GB/s copy\n", o.preset,
               config.num_hidden_layers, engine.attention_name(), gemm_flops / 1e12, copy_bytes / 1e9);
    model::Rng rng(7);
    const auto random_token = [&] { return static_cast<int32_t>(rng.next() % static_cast<uint64_t>(config.vocab_size)); };

    for (const int context : o.contexts) {
      for (const int batch : o.batches) {
        for (int i = 0; i < batch; ++i) {
          engine.allocate(i, context + o.steps + o.warmup + 2);
          engine.assume_prefilled(i, context);
        }
        std::vector<int32_t> tokens(static_cast<size_t>(batch));
        for (int32_t& t : tokens) t = random_token();
        std::vector<model::StepSequence> step(static_cast<size_t>(batch));
        const auto run_step = [&] {
          for (int i = 0; i < batch; ++i) {
            step[i].id = i;
            step[i].token_ids = std::span<const int32_t>(&tokens[static_cast<size_t>(i)], 1);
            step[i].sample = true;
          }
          const model::StepOutput out = engine.step(step);
          for (int i = 0; i < batch; ++i) {
            FULCRUM_CHECK(out.errors[i].empty(), "bench generate: {}", out.errors[i]);
            tokens[static_cast<size_t>(i)] = out.tokens[i];
          }
        };
        // One step's distinct experts (the bytes its experts read), from the recorder's counts.
        engine.reset_expert_counts();
        run_step();
        int64_t distinct = 0;
        for (const int64_t n : engine.expert_counts()) distinct += n > 0;
        for (int w = 0; w < o.warmup; ++w) run_step();
        std::vector<double> times, device_span, device_forward;
        const gpu::GpuEngine::Counters before = engine.counters();
        if (o.profile) cudaProfilerStart();
        for (int s = 0; s < o.steps; ++s) {
          const double t0 = now_s();
          run_step();
          times.push_back(1e3 * (now_s() - t0));
          const gpu::GpuEngine::DeviceTimes device = engine.last_step_device_times();
          device_span.push_back(device.span_ms);
          device_forward.push_back(device.forward_ms);
        }
        if (o.profile) cudaProfilerStop();
        const int64_t replays = engine.counters().graph_replays - before.graph_replays;
        for (int i = 0; i < batch; ++i) engine.release(i);
        const double ms = median(times);
        const double roofline_ms = 1e3 * decode_bytes(config, o.fp8_dense_gemms, batch, context, distinct) / copy_bytes;
        // On the device (CUDA events; GpuEngine::last_step_device_times): the rest of ms is host work between steps.
        const double span_ms = median(device_span), forward_ms = median(device_forward);
        fmt::print("decode batch {:4} context {:5}: {:8.3f} ms/step {:10.0f} tok/s | roofline {:.3f} ms ({:.1f}%), {} experts "
                   "touched, {} of {} steps graph replays | device {:.3f} ms (forward {:.3f})\n",
                   batch, context, ms, batch / ms * 1e3, roofline_ms, 100 * roofline_ms / ms, distinct, replays, o.steps,
                   span_ms, forward_ms);
        runs.push_back({{"model", o.preset}, {"phase", "decode"}, {"batch", batch}, {"context", context}, {"tokens", batch},
                        {"ms_per_step", ms}, {"tokens_per_s", batch / ms * 1e3}, {"roofline_ms", roofline_ms},
                        {"experts_touched", distinct}, {"graph_replays", replays}, {"device_span_ms", span_ms},
                        {"device_forward_ms", forward_ms}, {"peer_ms_per_step", nullptr}});
      }
    }
    for (const Prefill& p : prefills) {
      std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(p.seqs), std::vector<int32_t>(static_cast<size_t>(p.len)));
      for (auto& prompt : prompts) std::generate(prompt.begin(), prompt.end(), random_token);
      std::vector<double> times;
      for (int r = 0; r < o.prefill_reps + 1; ++r) {  // the first is a warm-up
        std::vector<model::StepSequence> step;
        for (int i = 0; i < p.seqs; ++i) {
          engine.allocate(i, p.len + 1);
          model::StepSequence seq;
          seq.id = i;
          seq.token_ids = prompts[static_cast<size_t>(i)];
          seq.sample = true;
          step.push_back(seq);
        }
        const double t0 = now_s();
        engine.step(step);
        if (r > 0) times.push_back(1e3 * (now_s() - t0));
        for (int i = 0; i < p.seqs; ++i) engine.release(i);
      }
      const double ms = median(times), tokens = double(p.seqs) * p.len;
      const double roofline_ms = 1e3 * prefill_flops(config, p.seqs, p.len) / gemm_flops;
      fmt::print("prefill {:2} x {:5}: {:8.3f} ms {:10.0f} tok/s | roofline {:.3f} ms ({:.1f}%)\n", p.seqs, p.len, ms,
                 tokens / ms * 1e3, roofline_ms, 100 * roofline_ms / ms);
      runs.push_back({{"model", o.preset}, {"phase", "prefill"}, {"batch", p.seqs}, {"context", p.len},
                      {"tokens", tokens}, {"ms_per_step", ms}, {"tokens_per_s", tokens / ms * 1e3},
                      {"roofline_ms", roofline_ms}, {"peer_ms_per_step", nullptr}});
    }
  }
  nlohmann::json peer;
  if (!o.peer_script.empty()) {  // after the engine freed the GPU
    const std::filesystem::path dir = std::filesystem::temp_directory_path() / fmt::format("fulcrum-peer-{}", getpid());
    std::filesystem::create_directories(dir);
    write_file_atomically((dir / "config.json").string(), config_json.dump(2));
    std::string cmd = fmt::format("python3 {} --config {} --context {} --batch", o.peer_script, dir.string(), o.peer_context);
    for (const int b : o.peer_batches) cmd += fmt::format(" {}", b);
    fmt::print("# peer: {}\n", cmd);
    std::fflush(stdout);
    std::string last, line;
    if (FILE* pipe = popen((cmd + " 2>&1").c_str(), "r")) {
      char buf[4096];
      while (fgets(buf, sizeof buf, pipe) != nullptr) {
        line = buf;
        if (!line.empty() && line[0] == '{') last = line;
        fmt::print("# peer| {}", line);
      }
      pclose(pipe);
    }
    std::filesystem::remove_all(dir);
    FULCRUM_CHECK(!last.empty(), "bench generate: the peer printed no result");
    peer = eplb::parse_json_text(last, "bench generate: the peer's result");
    for (const auto& pr : peer["runs"]) {
      for (auto& r : runs) {
        if (r["phase"] == "decode" && r["batch"] == pr["batch"] && r["context"] == pr["context"]) {
          r["peer_ms_per_step"] = pr["ms_per_step"];
          fmt::print("decode batch {:4} context {:5}: fulcrum {:.3f} ms, HF transformers {:.3f} ms: {:.1f}x\n",
                     r["batch"].get<int>(), r["context"].get<int>(), r["ms_per_step"].get<double>(),
                     pr["ms_per_step"].get<double>(), pr["ms_per_step"].get<double>() / r["ms_per_step"].get<double>());
        }
      }
    }
  }
  if (!o.json_path.empty()) {
    nlohmann::json doc{{"command", command_line()}, {"git_commit", o.git_commit}, {"gpu", machine["gpu"]},
                       {"machine", machine}, {"copy_bandwidth_gbs", copy_bytes / 1e9}, {"gemm_tflops", gemm_flops / 1e12},
                       {"layers", config.num_hidden_layers}, {"fp8_experts", gpu::DeviceWeights::fp8_experts_for(config)}, {"fp8_dense_gemms", o.fp8_dense_gemms}, {"runs", runs}, {"peer", peer}};
    write_file_atomically(o.json_path, doc.dump(2) + "\n");
  }
}

}  // namespace

void register_bench_generate_command(CLI::App& bench) {
  auto o = std::make_shared<BenchGenerateOptions>();
  CLI::App* cmd = bench.add_subcommand("generate", "The GPU engine at a real Qwen3-MoE shape: decode and prefill vs roofline and HF");
  cmd->add_option("--preset", o->preset, "qwen3-30b-a3b | qwen3-235b-a22b")->capture_default_str();
  cmd->add_option("--layers", o->layers, "Decoder layers (0: the preset's)")->capture_default_str()->check(CLI::Range(0, 1000));
  cmd->add_flag("--fp8", o->fp8, "The preset's FP8 checkpoint layout: experts e4m3 with 128x128 block scales on the device");
  cmd->add_flag("--fp8-dense-gemms", o->fp8_dense_gemms, "With --fp8: the dense projections stay FP8 too (default: bf16 copies)");
  cmd->add_option("--batch", o->batches, "Decode batch sizes")->capture_default_str()->check(CLI::Range(1, 4096));
  cmd->add_option("--context", o->contexts, "Decode context lengths")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--prefill", o->prefills, "Prefills SEQSxTOKENS (none: no prefill runs)")->capture_default_str();
  cmd->add_option("--steps", o->steps, "Timed decode steps (median)")->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "Untimed decode steps first")->capture_default_str();
  cmd->add_option("--prefill-reps", o->prefill_reps, "Timed prefills (median)")->capture_default_str();
  cmd->add_option("--attention", o->attention, "auto | fulcrum | flashinfer")->capture_default_str();
  cmd->add_option("--skinny-max-entries", o->skinny_max_entries,
                  "MoE steps of at most this many tokens x top-k run the skinny expert GEMMs (0: always CUTLASS)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1024}));
  cmd->add_option("--peer", o->peer_script, "HF transformers peer script (bench/peer/hf_decode_peer.py); empty: none");
  cmd->add_option("--peer-batch", o->peer_batches, "Peer decode batch sizes")->capture_default_str();
  cmd->add_option("--peer-context", o->peer_context, "Peer decode context")->capture_default_str();
  cmd->add_flag("!--no-cuda-graphs", o->cuda_graphs, "Decode steps run eagerly (no CUDA graphs)");
  cmd->add_flag("--profile", o->profile, "cudaProfilerStart/Stop around the timed decode steps (for ncu --profile-from-start off)");
  cmd->add_option("--json", o->json_path, "Write the results here (JSON; written whole or not at all)");
  cmd->add_option("--git-commit", o->git_commit, "Commit recorded in the JSON")->capture_default_str();
  cmd->callback([o] { run_bench_generate(*o); });
}

}  // namespace fulcrum::cli
