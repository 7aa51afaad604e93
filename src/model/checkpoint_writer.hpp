#pragma once
// Streams a checkpoint folder of F32 or BF16 safetensors without holding it in memory: tensors are
// produced chunk by chunk by a callback, converted and written in order. Above `max_shard_bytes` the
// tensors are split over model-0000i-of-0000N.safetensors with a model.safetensors.index.json
// (HF layout: {"metadata": {"total_size"}, "weight_map": {name: file}}); otherwise one model.safetensors.
// Each file is written to a temporary name and renamed into place.
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/safetensors.hpp"

namespace fulcrum::model {

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::optional<Dtype> dtype;  // this tensor's dtype when not the checkpoint's (an FP8 weight, its F32 scales)
  int64_t numel() const;
};

// Called once per tensor; must call `emit` with consecutive chunks totalling exactly spec.numel() values.
using TensorProducer =
    std::function<void(const TensorSpec& spec, const std::function<void(std::span<const float>)>& emit)>;

struct CheckpointLayout {
  std::vector<std::string> files;                  // shard file names, in write order
  std::map<std::string, std::string> file_of;      // tensor name -> file name
  uint64_t total_tensor_bytes = 0;                 // data bytes of all tensors (the index's total_size)
};

// Which file each tensor goes to: consecutive tensors fill a shard up to max_shard_bytes (a tensor larger
// than that gets a shard of its own).
CheckpointLayout plan_checkpoint_layout(const std::vector<TensorSpec>& specs, Dtype dtype, uint64_t max_shard_bytes);

// Writes every tensor of `specs` (in that order) into `dir`, which must exist. `dtype` (F32 or BF16) is
// the dtype of every spec without one of its own; a spec's own may also be F8_E4M3 (values are encoded
// round-to-nearest-even, saturating at +-448: producers emit values fp8 holds exactly).
CheckpointLayout write_checkpoint(const std::string& dir, const std::vector<TensorSpec>& specs, Dtype dtype,
                                  uint64_t max_shard_bytes, const TensorProducer& produce,
                                  const std::map<std::string, std::string>& metadata = {});

// Round-to-nearest-even fp32 -> float8_e4m3fn bits, saturating at +-448 (NaN -> 0x7f).
uint8_t f32_to_f8e4m3_bits(float value);
// Round-to-nearest-even fp32 -> bf16 bits, and back.
uint16_t f32_to_bf16_bits(float value);
float bf16_bits_to_f32(uint16_t bits);
// Rounds every value to what the dtype stores (bf16: 8 significant bits; f32: unchanged).
void round_to_dtype(std::span<float> values, Dtype dtype);

}  // namespace fulcrum::model
