// Options of `fulcrum bench moe` checked without CUDA (the CLI of every build reports bad flags the same way).
#include <filesystem>

#include <fmt/format.h>

#include "bench_moe/moe_bench.hpp"
#include "eplb/error.hpp"
#include "eplb/loads.hpp"

namespace fulcrum::bench_moe {

ModelShape model_shape(const std::string& name) {
  if (name == "qwen3-30b-a3b") return {name, 2048, 768, 48};
  if (name == "qwen3-235b-a22b") return {name, 4096, 1536, 94};
  throw Error(fmt::format("unknown model '{}' (known: qwen3-30b-a3b, qwen3-235b-a22b)", name));
}

void validate(const MoeBenchOptions& opt) {
  FULCRUM_CHECK(!opt.models.empty(), "--models: name at least one model");
  for (const auto& m : opt.models) model_shape(m);
  FULCRUM_CHECK(!opt.tokens.empty(), "--tokens: give at least one batch size");
  for (const int64_t t : opt.tokens) FULCRUM_CHECK(t > 0 && t <= (int64_t{1} << 20), "--tokens {}: must be in [1, 1048576]", t);
  FULCRUM_CHECK(opt.reps > 0 && opt.warmup >= 0, "--reps must be positive and --warmup >= 0");
  FULCRUM_CHECK(opt.gpus >= 1, "--gpus must be at least 1, got {}", opt.gpus);
  // One GPU simulates --ep ranks; several GPUs are the EP ranks themselves.
  const int ep = opt.gpus > 1 ? opt.gpus : opt.ep;
  const char* ep_flag = opt.gpus > 1 ? "--gpus" : "--ep";
  FULCRUM_CHECK(ep >= 1 && kMoeBenchExperts % ep == 0 && (kMoeBenchExperts + opt.redundant) % ep == 0,
                "{} {} with --redundant {}: the EP ranks must divide both 128 experts and 128 + redundant slots",
                ep_flag, ep, opt.redundant);
  FULCRUM_CHECK(opt.passes > 0 && opt.layers_per_pass >= 0, "--passes must be positive and --layers-per-pass >= 0");
  FULCRUM_CHECK(!opt.loads.empty(), "--loads: a load matrix CSV is required (../shared/data/loads/*.csv)");
  if (!opt.json_path.empty()) {  // fail now, not after the whole run
    const std::filesystem::path dir = std::filesystem::absolute(opt.json_path).parent_path();
    FULCRUM_CHECK(std::filesystem::is_directory(dir), "--json {}: folder {} does not exist", opt.json_path, dir.string());
  }
  FULCRUM_CHECK(opt.torch_peer == "auto" || opt.torch_peer == "off" || std::filesystem::is_regular_file(opt.torch_peer),
                "--torch-peer {}: no such file (a script path, auto or off)", opt.torch_peer);
  const eplb::LoadMatrix loads = eplb::read_loads_file(opt.loads);
  FULCRUM_CHECK(loads.num_logical_experts == kMoeBenchExperts, "{}: {} experts, the Qwen3 shapes have 128", opt.loads,
                loads.num_logical_experts);
  FULCRUM_CHECK(opt.loads_layer >= -1, "--loads-layer {}: a layer index, or -1 for the least balanced layer",
                opt.loads_layer);
  FULCRUM_CHECK(opt.loads_layer < loads.num_layers, "--loads-layer {} but {} has {} layers", opt.loads_layer, opt.loads,
                loads.num_layers);
}

}  // namespace fulcrum::bench_moe
