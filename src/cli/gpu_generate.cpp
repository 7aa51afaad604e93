// `fulcrum generate --device cuda`: the GPU engine (src/gpu/) in place of the op-by-op backend, on one GPU, or as
// attention data-parallel + expert-parallel ranks (threads of this process, one engine each).
#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_backend.hpp"
#include "cli/gpu_commands.hpp"
#include "comm/host_staged_exchange.hpp"
#include "comm/in_process_communicator.hpp"
#include "eplb/error.hpp"
#include "eplb/atomic_file.hpp"
#include "engine/rank_eplb.hpp"
#include "gpu/gpu_generate.hpp"
#include "gpu/gpu_rank_eplb.hpp"

namespace fulcrum::cli {
namespace {

// KV pages that hold exactly these prompts and their new tokens (at least one).
int64_t kv_pages_for(const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens, int page_size) {
  int64_t pages = 0;
  for (const auto& p : prompts) pages += (static_cast<int64_t>(p.size()) + max_new_tokens + page_size - 1) / page_size;
  return std::max<int64_t>(pages, 1);
}

// Options of an engine for exactly these prompts (per rank: that rank's): its pages take what the prompts need,
// not most of the GPU.
gpu::GpuEngineOptions options_for(const model::Qwen3MoeConfig& config, const engine::ParallelLayout& layout,
                                  const engine::InProcessRun& run, const std::vector<std::vector<int32_t>>& prompts) {
  gpu::GpuEngineOptions options;
  options.placement = engine::prepare_in_process_run(config, layout, run);
  options.dispatch = run.engine.dispatch_algorithm;
  options.dispatch_seed = run.engine.dispatch_seed;
  options.fp8_dense_gemms = run.fp8_dense_gemms;
  options.max_batch_seqs = std::max<int>(1, static_cast<int>(prompts.size()));
  options.max_batch_tokens = std::max<int64_t>(options.max_batch_seqs, 8192);
  options.kv_pages = kv_pages_for(prompts, run.decode.max_new_tokens, options.page_size);
  return options;
}

std::string engine_line(const gpu::GpuEngine& engine, const gpu::GpuGenerateStats& stats) {
  const auto& c = engine.counters();
  return fmt::format("attention {}, prefill {:.3f} s, decode {} steps in {:.3f} s ({:.3f} ms/step), {} eager steps, {} "
                     "graphs captured, {} replays; KV pool {} pages of {}",
                     engine.attention_name(), stats.prefill_seconds, stats.decode_steps, stats.decode_seconds,
                     stats.decode_steps > 0 ? 1e3 * stats.decode_seconds / static_cast<double>(stats.decode_steps) : 0.0,
                     c.eager_steps, c.graph_captures, c.graph_replays, engine.kv_pool().num_pages(),
                     engine.kv_pool().page_size());
}

// What both paths print and write: tokens, the logits dump, each engine's line, the expert distribution.
void report(const model::Qwen3MoeConfig& config, const engine::ParallelLayout& layout, const engine::InProcessRun& run,
            const std::vector<std::vector<int32_t>>& prompts, const model::GenerateResult& result, double seconds,
            const std::string& where, const std::vector<std::string>& engine_lines, const std::vector<int64_t>& counts,
            const std::string& dump_logits_file) {
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
  fmt::print("# {} sequences, {} tokens in {:.3f} s on {}{}\n", prompts.size(), num_tokens, seconds, where,
             dump_logits_file.empty() ? std::string() : fmt::format(", prompt logits checksum {:.6f}", checksum));
  for (size_t r = 0; r < engine_lines.size(); ++r) {
    fmt::print("# gpu engine{}: {}\n", engine_lines.size() > 1 ? fmt::format(" rank {}", r) : "", engine_lines[r]);
  }
  if (!run.dump_file.empty()) {
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

}  // namespace

void generate_on_gpu(const std::string& model_dir, const model::Qwen3MoeConfig& config,
                     const engine::ParallelLayout& layout, const engine::InProcessRun& run,
                     const std::vector<std::vector<int32_t>>& prompts, const std::string& dump_logits_file) {
  const auto start = std::chrono::steady_clock::now();
  gpu::GpuEngine engine(config, options_for(config, layout, run, prompts));
  engine.load_weights(model_dir, run.weight_cache_dir, [&](int done, int total) {
    if (run.on_layer_loaded) run.on_layer_loaded(0, done, total);
  });
  gpu::GpuGenerateStats stats;
  const model::GenerateResult result = gpu::gpu_generate(engine, prompts, run.decode, !dump_logits_file.empty(), &stats);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report(config, layout, run, prompts, result, seconds, "the GPU engine", {engine_line(engine, stats)},
         run.dump_file.empty() ? std::vector<int64_t>{} : engine.expert_counts(), dump_logits_file);
}

void generate_on_gpu_ranks(const std::string& model_dir, const model::Qwen3MoeConfig& config,
                           const engine::ParallelLayout& layout, const engine::InProcessRun& run,
                           const std::vector<std::vector<int32_t>>& prompts, const std::string& dump_logits_file) {
  FULCRUM_CHECK(engine::runs_gpu_engine_ranks(layout.flags(), run), "generate: the GPU engine's ranks take --device "
                "cuda --tp W --dp W --enable-dp-attention --ep W (one pipeline stage); the layout is {}", layout.describe());
  const std::string why = engine::why_gpu_engine_ranks_cannot_run(run);
  FULCRUM_CHECK(why.empty(), "{}", why);
  const auto start = std::chrono::steady_clock::now();
  const int w = layout.world_size();
  const int devices = backend::CudaBackend::device_count();
  FULCRUM_CHECK(devices > 0, "--device cuda: no CUDA device is visible");
  // Prompt i on rank i % W (its attention data-parallel group), drawing from sequence i's stream.
  std::vector<std::vector<std::vector<int32_t>>> mine(static_cast<size_t>(w));
  std::vector<gpu::GpuGenerateRank> ranks(static_cast<size_t>(w));
  for (size_t i = 0; i < prompts.size(); ++i) {
    mine[i % w].push_back(prompts[i]);
    ranks[i % w].sequence_index.push_back(i);
  }
  size_t most = 1;
  for (const auto& p : mine) most = std::max(most, p.size());
  // The capacity of the rank with the most prompts on every rank (the same chunking); each rank's own KV pages.
  const gpu::GpuEngineOptions base = options_for(config, layout, run, mine[0]);
  std::vector<gpu::GpuEngineOptions> options(static_cast<size_t>(w), base);
  int64_t prefill_steps = 0;
  for (int r = 0; r < w; ++r) {
    gpu::GpuEngineOptions& o = options[static_cast<size_t>(r)];
    o.max_batch_seqs = static_cast<int>(most);
    o.max_batch_tokens = std::max<int64_t>(static_cast<int64_t>(most), 8192);
    o.kv_pages = kv_pages_for(mine[static_cast<size_t>(r)], run.decode.max_new_tokens, o.page_size);
    o.device = r % devices;
    prefill_steps = std::max(prefill_steps, gpu::gpu_prefill_steps(mine[static_cast<size_t>(r)], o.max_batch_tokens,
                                                                   o.max_batch_seqs));
  }
  for (gpu::GpuGenerateRank& rank : ranks) rank.prefill_steps = prefill_steps;
  std::vector<model::GenerateResult> results(static_cast<size_t>(w));
  std::vector<std::string> lines(static_cast<size_t>(w));
  std::vector<int64_t> counts;
  std::mutex counts_mutex;
  // Live EPLB (--enable-eplb): rank 0's rebalance reports (the same on every rank) and every rank's slots moved.
  std::vector<eplb_runtime::RebalanceReport> rebalances;
  std::vector<int64_t> slots_moved(static_cast<size_t>(w), 0);
  comm::run_in_process(w, [&](int r, comm::Communicator& comm) {
    const auto ur = static_cast<size_t>(r);
    comm::HostStagedExchange exchange(comm, options[ur].device);
    options[ur].ep = &exchange;
    gpu::GpuEngine engine(config, options[ur]);
    engine.load_weights(model_dir, "", [&](int done, int total) {
      if (run.on_layer_loaded && r == 0) run.on_layer_loaded(0, done, total);
    });
    std::optional<gpu::GpuRankEplb> eplb;
    if (run.eplb.enabled) {
      eplb_runtime::ManagerOptions manager = engine::manager_options_of(run.eplb);
      manager.log = engine::eplb_log_of(run.eplb, /*this_rank_logs=*/r == 0);
      eplb.emplace(engine, exchange, std::move(manager));
      ranks[ur].after_step = [&eplb] { eplb->after_step(); };
    }
    gpu::GpuGenerateStats stats;
    results[ur] = gpu::gpu_generate(engine, mine[ur], run.decode, !dump_logits_file.empty(), &stats, &ranks[ur]);
    lines[ur] = engine_line(engine, stats);
    if (eplb) {
      slots_moved[ur] = eplb->slots_moved();
      if (r == 0) rebalances = eplb->rebalances();
    }
    if (run.dump_file.empty()) return;
    const std::vector<int64_t> own = engine.expert_counts();  // this rank's tokens
    const std::lock_guard<std::mutex> lock(counts_mutex);
    if (counts.empty()) counts.assign(own.size(), 0);
    for (size_t k = 0; k < own.size(); ++k) counts[k] += own[k];
  });
  model::GenerateResult result;
  result.new_tokens.resize(prompts.size());
  if (!dump_logits_file.empty()) result.prompt_logits.resize(prompts.size());
  for (int r = 0; r < w; ++r) {
    const auto ur = static_cast<size_t>(r);
    for (size_t k = 0; k < ranks[ur].sequence_index.size(); ++k) {
      const size_t i = ranks[ur].sequence_index[k];
      result.new_tokens[i] = results[ur].new_tokens[k];
      if (!dump_logits_file.empty()) result.prompt_logits[i] = results[ur].prompt_logits[k];
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report(config, layout, run, prompts, result, seconds,
         fmt::format("{} GPU engine ranks (threads on {} GPU(s), rows staged through host memory)", w, std::min(w, devices)),
         lines, counts, dump_logits_file);
  if (run.eplb.enabled) {
    const auto changed = std::count_if(rebalances.begin(), rebalances.end(), [](const auto& r) { return !r.skipped; });
    fmt::print("# eplb: {} rebalances ({} changed the placement), slots that received another expert per rank: {}\n",
               rebalances.size(), changed, fmt::join(slots_moved, " "));
  }
}

}  // namespace fulcrum::cli
