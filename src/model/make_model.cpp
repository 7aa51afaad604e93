#include "model/make_model.hpp"

#include <filesystem>
#include <fstream>
#include <set>

#include <unistd.h>

#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "eplb/loads.hpp"
#include "model/checkpoint_writer.hpp"
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
  if (text == "fp8" || text == "float8_e4m3fn" || text == "f8_e4m3") return Dtype::kF8E4M3;
  throw Error(fmt::format("unknown dtype '{}' (known: bf16, fp32, fp8)", text));
}

std::vector<TensorSpec> fp8_checkpoint_specs(const Qwen3MoeConfig& config) {
  FULCRUM_CHECK(config.quantization.has_value(), "fp8 checkpoint specs need a quantized config");
  const std::vector<std::string> weights = fp8_weight_names(config);
  const std::set<std::string> quantized(weights.begin(), weights.end());
  const int64_t block_rows = config.quantization->block_rows, block_cols = config.quantization->block_cols;
  std::vector<TensorSpec> specs;
  for (TensorSpec spec : synthetic_tensor_specs(config)) {
    if (!quantized.count(spec.name)) {
      specs.push_back(std::move(spec));
      continue;
    }
    const std::vector<int64_t> blocks = {(spec.shape[0] + block_rows - 1) / block_rows,
                                         (spec.shape[1] + block_cols - 1) / block_cols};
    spec.dtype = Dtype::kF8E4M3;
    specs.push_back(spec);
    specs.push_back(TensorSpec{spec.name + kScaleInvSuffix, blocks, Dtype::kF32});
  }
  return specs;
}

void quantize_fp8_blocks(std::span<const float> weight, int64_t rows, int64_t cols, const Fp8BlockQuantization& block,
                         std::span<float> fp8_values, std::span<float> scale_inv) {
  const int64_t num_col_blocks = (cols + block.block_cols - 1) / block.block_cols;
  const int64_t num_row_blocks = (rows + block.block_rows - 1) / block.block_rows;
  FULCRUM_CHECK(static_cast<int64_t>(weight.size()) == rows * cols && fp8_values.size() == weight.size() &&
                    static_cast<int64_t>(scale_inv.size()) == num_row_blocks * num_col_blocks,
                "quantize_fp8_blocks: sizes do not match [{}, {}]", rows, cols);
  for (int64_t br = 0; br < num_row_blocks; ++br) {
    for (int64_t bc = 0; bc < num_col_blocks; ++bc) {
      const int64_t r0 = br * block.block_rows, r1 = std::min(rows, r0 + block.block_rows);
      const int64_t c0 = bc * block.block_cols, c1 = std::min(cols, c0 + block.block_cols);
      float max_abs = 0;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) max_abs = std::max(max_abs, std::abs(weight[r * cols + c]));
      }
      // An all-zero block keeps scale 1 (a zero scale is invalid); its values encode as zeros.
      const float scale = max_abs > 0 ? max_abs / 448.0f : 1.0f;
      scale_inv[br * num_col_blocks + bc] = scale;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          fp8_values[r * cols + c] = f8e4m3_to_f32(f32_to_f8e4m3_bits(weight[r * cols + c] / scale));
        }
      }
    }
  }
}

MakeModelResult make_model(const MakeModelOptions& options) {
  // fp8: linear weights F8_E4M3 with F32 block scales, everything else bf16 (the Qwen3-*-FP8 layout).
  const bool fp8 = options.dtype == Dtype::kF8E4M3;
  const Dtype base_dtype = fp8 ? Dtype::kBF16 : options.dtype;
  nlohmann::json config_json =
      preset_config_json(options.preset, PresetOverrides{options.layers, options.experts, base_dtype, options.vocab_size});
  if (fp8) {
    config_json["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                                          {"weight_block_size", {128, 128}}};
  }
  MakeModelResult result;
  result.config = parse_qwen3_moe_config(config_json, "preset " + options.preset);
  const Qwen3MoeConfig& config = result.config;
  const std::vector<TensorSpec> specs = fp8 ? fp8_checkpoint_specs(config) : synthetic_tensor_specs(config);
  for (const TensorSpec& spec : specs) {
    const bool is_scale = spec.name.ends_with(kScaleInvSuffix);
    if (!is_scale) result.num_parameters += static_cast<uint64_t>(spec.numel());
    result.bytes += static_cast<uint64_t>(spec.numel()) * dtype_size(spec.dtype.value_or(base_dtype));
  }

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
      std::vector<float> scale_inv;  // of the last FP8 weight written, which its scale tensor follows
      const TensorProducer produce = [&](const TensorSpec& spec, const auto& emit) {
        if (spec.dtype == Dtype::kF32 && spec.name.ends_with(kScaleInvSuffix)) {
          emit(std::span<const float>(scale_inv));
          return;
        }
        if (spec.dtype != Dtype::kF8E4M3) {
          weights.produce(spec, emit);
          return;
        }
        std::vector<float> weight;  // the whole [out, in] weight: its blocks span 128 rows
        weight.reserve(static_cast<size_t>(spec.numel()));
        weights.produce(TensorSpec{spec.name, spec.shape}, [&](std::span<const float> chunk) {
          weight.insert(weight.end(), chunk.begin(), chunk.end());
        });
        std::vector<float> fp8_values(weight.size());
        const Fp8BlockQuantization& block = *config.quantization;
        scale_inv.resize(static_cast<size_t>(((spec.shape[0] + block.block_rows - 1) / block.block_rows) *
                                             ((spec.shape[1] + block.block_cols - 1) / block.block_cols)));
        quantize_fp8_blocks(weight, spec.shape[0], spec.shape[1], *config.quantization, fp8_values, scale_inv);
        emit(std::span<const float>(fp8_values));
      };
      result.num_files = static_cast<int>(
          write_checkpoint(staging.string(), specs, base_dtype, options.max_shard_bytes, produce, metadata).files.size());
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
