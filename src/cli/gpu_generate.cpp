// `fulcrum generate --device cuda` on one GPU: the GPU engine (src/gpu/) in place of the op-by-op backend.
#include <chrono>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "cli/gpu_commands.hpp"
#include "eplb/error.hpp"
#include "eplb/atomic_file.hpp"
#include "gpu/gpu_generate.hpp"

namespace fulcrum::cli {

void generate_on_gpu(const std::string& model_dir, const model::Qwen3MoeConfig& config,
                     const engine::ParallelLayout& layout, const engine::InProcessRun& run,
                     const std::vector<std::vector<int32_t>>& prompts, const std::string& dump_logits_file) {
  const auto start = std::chrono::steady_clock::now();
  gpu::GpuEngineOptions options;
  options.placement = engine::prepare_in_process_run(config, layout, run);
  options.dispatch = run.engine.dispatch_algorithm;
  options.dispatch_seed = run.engine.dispatch_seed;
  options.fp8_dense_gemms = run.fp8_dense_gemms;
  int64_t longest = 1;
  for (const auto& p : prompts) longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()) + run.decode.max_new_tokens);
  // Pages for exactly this run: the pool then takes what the prompts need, not most of the GPU.
  options.max_batch_seqs = std::max<int>(1, static_cast<int>(prompts.size()));
  options.max_batch_tokens = std::max<int64_t>(options.max_batch_seqs, 8192);
  int64_t pages = 0;
  for (const auto& p : prompts) {
    pages += (static_cast<int64_t>(p.size()) + run.decode.max_new_tokens + options.page_size - 1) / options.page_size;
  }
  options.kv_pages = std::max<int64_t>(pages, 1);
  gpu::GpuEngine engine(config, options);
  engine.load_weights(model_dir, run.weight_cache_dir, [&](int done, int total) {
    if (run.on_layer_loaded) run.on_layer_loaded(0, done, total);
  });
  gpu::GpuGenerateStats stats;
  const model::GenerateResult result = gpu::gpu_generate(engine, prompts, run.decode, !dump_logits_file.empty(), &stats);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  if (!dump_logits_file.empty()) {
    std::map<std::string, model::HostTensor> dump;
    for (size_t i = 0; i < prompts.size(); ++i) dump["seq" + std::to_string(i) + ".logits"] = result.prompt_logits[i];
    model::write_safetensors(dump_logits_file, dump, {{"format", "pt"}});
  }
  fmt::print("# layout: {}\n", layout.describe());
  size_t num_tokens = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    num_tokens += prompts[i].size() + result.new_tokens[i].size();
    fmt::print("seq{}: {}\n", i, fmt::join(result.new_tokens[i], " "));
  }
  double checksum = 0;
  for (const model::HostTensor& t : result.prompt_logits) {
    for (const float v : t.data) checksum += v;
  }
  fmt::print("# {} sequences, {} tokens in {:.3f} s on the GPU engine{}\n", prompts.size(), num_tokens, seconds,
             dump_logits_file.empty() ? std::string() : fmt::format(", prompt logits checksum {:.6f}", checksum));
  const auto& c = engine.counters();
  fmt::print("# gpu engine: attention {}, prefill {:.3f} s, decode {} steps in {:.3f} s ({:.3f} ms/step), "
             "{} eager steps, {} graphs captured, {} replays; KV pool {} pages of {}\n",
             engine.attention_name(), stats.prefill_seconds, stats.decode_steps, stats.decode_seconds,
             stats.decode_steps > 0 ? 1e3 * stats.decode_seconds / static_cast<double>(stats.decode_steps) : 0.0,
             c.eager_steps, c.graph_captures, c.graph_replays, engine.kv_pool().num_pages(), engine.kv_pool().page_size());
  if (!run.dump_file.empty()) {
    const std::vector<int64_t> counts = engine.expert_counts();
    const int num_moe = static_cast<int>(config.moe_layer_indices().size());
    nlohmann::json rows = nlohmann::json::array();
    for (int l = 0; l < num_moe; ++l) {
      rows.push_back(std::vector<int64_t>(counts.begin() + static_cast<ptrdiff_t>(l) * config.num_experts,
                                          counts.begin() + static_cast<ptrdiff_t>(l + 1) * config.num_experts));
    }
    write_file_atomically(run.dump_file, nlohmann::json{{"logical_count", rows}}.dump() + "\n");
    fmt::print("# expert distribution written to {}\n", run.dump_file);
  }
  if (!dump_logits_file.empty()) fmt::print("# prompt logits written to {}\n", dump_logits_file);
}

}  // namespace fulcrum::cli
