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
#include <string>

#include "model/qwen3_config.hpp"
#include "model/router_skew.hpp"
#include <utility>
#include <vector>

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

// Parses "bf16" / "fp32" (also "bfloat16", "float32").
Dtype parse_make_model_dtype(const std::string& text);

MakeModelResult make_model(const MakeModelOptions& options);

}  // namespace fulcrum::model
