#include "model/make_model.hpp"

#include <filesystem>
#include <fstream>

#include <unistd.h>

#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "eplb/loads.hpp"
#include "model/synthetic_model.hpp"

namespace fulcrum::model {
namespace {

namespace fs = std::filesystem;

double gib(uint64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(uint64_t{1} << 30); }

// MemAvailable of /proc/meminfo in bytes, or 0 when unknown.
uint64_t available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

// The output must be absent or an empty folder (its parents are created); returns its absolute path.
fs::path check_output(const std::string& output) {
  FULCRUM_CHECK(!output.empty(), "--output is required");
  const fs::path path = fs::absolute(fs::path(output)).lexically_normal();
  if (fs::exists(path)) {
    FULCRUM_CHECK(fs::is_directory(path) && fs::is_empty(path), "{}: exists and is not an empty folder", output);
  }
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  FULCRUM_CHECK(fs::is_directory(path.parent_path()), "{}: cannot create the parent folder{}", output,
                ec ? ": " + ec.message() : "");
  return path;
}

void write_report(const fs::path& dir, const MakeModelOptions& options, const MakeModelResult& result) {
  nlohmann::json report = {{"preset", options.preset}, {"seed", options.seed}, {"dtype", dtype_name(options.dtype)},
                           {"num_parameters", result.num_parameters}, {"bytes", result.bytes}};
  if (result.fit) {
    const RouterFit& fit = *result.fit;
    report["router_skew"] = {
        {"loads", options.router_skew},
        {"layer_mapping", "MoE layer k follows load row k mod num_load_rows"},
        {"calibration_rounds", result.calibration->rounds},
        {"calibration_tokens", options.calibration.num_tokens},
        {"measure_tokens", options.measure_tokens},
        {"pearson", fit.pearson},
        {"max_abs_error", fit.max_abs_error},
        {"ranks", fit.ranks},
        {"trivial_balancedness_measured", fit.trivial_balancedness_measured},
        {"trivial_balancedness_target", fit.trivial_balancedness_target},
    };
  }
  write_file_atomically((dir / "make_model_report.json").string(), report.dump(2) + "\n");
}

}  // namespace

Dtype parse_make_model_dtype(const std::string& text) {
  if (text == "bf16" || text == "bfloat16") return Dtype::kBF16;
  if (text == "fp32" || text == "float32" || text == "f32") return Dtype::kF32;
  throw Error(fmt::format("unknown dtype '{}' (known: bf16, fp32)", text));
}

MakeModelResult make_model(const MakeModelOptions& options) {
  const nlohmann::json config_json =
      preset_config_json(options.preset, PresetOverrides{options.layers, options.experts, options.dtype, options.vocab_size});
  MakeModelResult result;
  result.config = parse_qwen3_moe_config(config_json, "preset " + options.preset);
  const Qwen3MoeConfig& config = result.config;
  const std::vector<TensorSpec> specs = synthetic_tensor_specs(config);
  for (const TensorSpec& spec : specs) result.num_parameters += static_cast<uint64_t>(spec.numel());
  result.bytes = result.num_parameters * dtype_size(options.dtype);

  FULCRUM_CHECK(!is_large_preset(options.preset) || options.layers > 0 || options.allow_large,
                "preset {} is {:.1f} GiB in {} with all {} layers; pass --layers N for a slice, or --allow-large",
                options.preset, gib(result.bytes), dtype_name(options.dtype), config.num_hidden_layers);
  // Loads first: a bad --router-skew fails before anything is written.
  std::optional<eplb::LoadMatrix> targets;
  if (!options.router_skew.empty()) {
    targets = router_skew_targets(eplb::read_loads_file(options.router_skew), config);
    const uint64_t needed = result.num_parameters * 4 + (uint64_t{1} << 28);  // fp32 model + activations
    const uint64_t available = available_memory();
    FULCRUM_CHECK(available == 0 || needed <= available,
                  "--router-skew calibrates an fp32 CPU model of {:.1f} GiB, only {:.1f} GiB of memory is available; "
                  "use fewer --layers",
                  gib(needed), gib(available));
  }
  const fs::path output = check_output(options.output);
  // Router skew rewrites the shards one by one (temporary file, then rename): one extra shard at the peak.
  const uint64_t needed_disk =
      result.bytes + (targets ? std::min(result.bytes, options.max_shard_bytes) : 0) + (uint64_t{64} << 20);
  const uint64_t free_disk = fs::space(output.parent_path()).available;
  FULCRUM_CHECK(needed_disk <= free_disk, "{}: needs {:.2f} GiB, only {:.2f} GiB free on disk", options.output,
                gib(needed_disk), gib(free_disk));

  const fs::path staging = output.parent_path() / fmt::format(".{}.partial.{}", output.filename().string(), ::getpid());
  fs::remove_all(staging);
  fs::create_directory(staging);
  try {
    write_file_atomically((staging / "config.json").string(), config_json.dump(2) + "\n");
    const std::map<std::string, std::string> metadata = {
        {"format", "pt"}, {"fulcrum.preset", options.preset}, {"fulcrum.seed", std::to_string(options.seed)}};
    const auto write = [&](const SyntheticWeights& weights) {
      const TensorProducer produce = [&](const TensorSpec& spec, const auto& emit) { weights.produce(spec, emit); };
      result.num_files = static_cast<int>(
          write_checkpoint(staging.string(), specs, options.dtype, options.max_shard_bytes, produce, metadata).files.size());
    };
    write(SyntheticWeights(config, options.seed));
    if (targets) {
      result.calibration = calibrate_router_bias(staging.string(), config, *targets, options.calibration);
      std::map<int, std::vector<float>> bias;
      for (size_t k = 0; k < result.calibration->bias.size(); ++k) bias[static_cast<int>(k)] = result.calibration->bias[k];
      write(SyntheticWeights(config, options.seed, std::move(bias)));  // same names and files: replaces them
      const eplb::LoadMatrix measured =
          measure_inclusion(staging.string(), config, options.measure_tokens, options.calibration.sequence_length,
                            options.calibration.seed + 1);  // held-out prompts
      result.fit = evaluate_router_fit(measured, *targets);
    }
    for (const auto& [name, contents] : options.extra_files) write_file_atomically((staging / name).string(), contents);
    write_report(staging, options, result);
    if (fs::exists(output)) fs::remove(output);  // an empty folder (checked above)
    fs::rename(staging, output);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    throw;
  }
  return result;
}

}  // namespace fulcrum::model
