#pragma once
// `fulcrum make-model`: writes a random Qwen3-MoE checkpoint folder (config.json + safetensors, HF
// layout) from a preset, optionally with routing skewed to follow a load matrix (router_skew.hpp).
//
// The folder is built in a sibling staging folder and renamed into place at the end, so `output` either
// does not exist or holds a complete checkpoint; `output` must not exist or be an empty folder.
// Size guards: the real-model presets need --layers (a slice) unless allow_large; the files must fit the
// free disk space, and router-skew calibration (an fp32 CPU model) must fit the available memory.
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "model/qwen3_config.hpp"
#include "model/router_skew.hpp"
#include <utility>
#include <vector>

#include "model/checkpoint_writer.hpp"
#include "model/safetensors.hpp"

namespace fulcrum::model {

struct MakeModelOptions {
  std::string preset;
  std::string output;
  int layers = 0;   // 0: the preset's num_hidden_layers
  int experts = 0;  // 0: the preset's num_experts
  int vocab_size = 0;  // 0: the preset's vocab_size
  uint64_t seed = 0;
  Dtype dtype = Dtype::kBF16;
  std::string router_skew;  // load matrix file (CSV or JSON); empty: no skew
  bool allow_large = false;
  uint64_t max_shard_bytes = uint64_t{2} << 30;
  RouterCalibrationOptions calibration;
  int measure_tokens = 4096;  // held-out tokens for the reported fit
  // Files written beside the weights as they are, (name, contents): e.g. a tokenizer.json.
  std::vector<std::pair<std::string, std::string>> extra_files;
};

struct MakeModelResult {
  Qwen3MoeConfig config;
  uint64_t num_parameters = 0;
  uint64_t bytes = 0;  // tensor data written
  int num_files = 0;   // safetensors files
  std::optional<RouterCalibration> calibration;
  std::optional<RouterFit> fit;
};

// Parses "bf16" / "fp32" / "fp8" (also "bfloat16", "float32", "float8_e4m3fn"). fp8 writes the
// Qwen3-*-FP8 layout: quantization_config in config.json, each linear weight (fp8_weight_names) F8_E4M3
// with F32 `_scale_inv` per 128x128 block, every other tensor bf16.
Dtype parse_make_model_dtype(const std::string& text);

// The tensors of an FP8 checkpoint of `config` (quantized): synthetic_tensor_specs with every linear
// weight F8_E4M3 and followed by its `<weight>_scale_inv` [ceil(out / 128), ceil(in / 128)] F32.
std::vector<TensorSpec> fp8_checkpoint_specs(const Qwen3MoeConfig& config);

// Block quantization of `weight` [rows, cols]: per block, scale_inv = max|W| / 448 (1 for an all-zero
// block) and fp8 = round-to-nearest-even of W / scale_inv. `fp8_values` [rows * cols] gets the fp8
// values as fp32 (exact), `scale_inv` [ceil(rows / br) * ceil(cols / bc)] the scales, row-major.
void quantize_fp8_blocks(std::span<const float> weight, int64_t rows, int64_t cols, const Fp8BlockQuantization& block,
                         std::span<float> fp8_values, std::span<float> scale_inv);

MakeModelResult make_model(const MakeModelOptions& options);

}  // namespace fulcrum::model
