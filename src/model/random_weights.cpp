#include "model/random_weights.hpp"

#include <cmath>

#include "eplb/error.hpp"
#include "model/checkpoint_writer.hpp"
#include "model/rng.hpp"

namespace fulcrum::model {

std::vector<uint16_t> random_bf16_reference(int64_t n, uint64_t seed, float scale) {
  FULCRUM_CHECK(n >= 0, "random_bf16_reference: negative count {}", n);
  std::vector<uint16_t> out(static_cast<size_t>(n));
  uint64_t state = seed;
  for (uint16_t& value : out) {
    const float u = static_cast<float>(splitmix64(state) >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    value = f32_to_bf16_bits((2.0f * u - 1.0f) * scale);
  }
  return out;
}

std::vector<uint8_t> random_e4m3_reference(int64_t n, uint64_t seed) {
  FULCRUM_CHECK(n >= 0, "random_e4m3_reference: negative count {}", n);
  std::vector<uint8_t> out(static_cast<size_t>(n));
  uint64_t state = seed;
  for (uint8_t& value : out) {
    const float u = static_cast<float>(splitmix64(state) >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    value = f32_to_f8e4m3_bits((2.0f * u - 1.0f) * 448.0f);
  }
  return out;
}

uint64_t expert_weight_seed(uint64_t seed, int layer_idx, int expert_idx, ExpertTensor tensor) {
  FULCRUM_CHECK(layer_idx >= 0 && expert_idx >= 0, "expert weights: layer {} expert {} (both must be >= 0)", layer_idx,
                expert_idx);
  // One splitmix64 step over a packed key: far-apart streams for neighbouring keys.
  uint64_t state = seed ^ (static_cast<uint64_t>(layer_idx) << 40) ^ (static_cast<uint64_t>(expert_idx) << 8) ^
                   static_cast<uint64_t>(tensor);
  return splitmix64(state);
}

float expert_weight_scale(ExpertTensor tensor, int hidden_size, int moe_intermediate_size) {
  const int fan_in = tensor == ExpertTensor::kGateUp ? hidden_size : moe_intermediate_size;
  FULCRUM_CHECK(fan_in > 0, "expert weights: fan-in {} must be positive", fan_in);
  return 1.0f / std::sqrt(static_cast<float>(fan_in));
}

float expert_fp8_block_scale(ExpertTensor tensor, int hidden_size, int moe_intermediate_size, int expert_idx) {
  FULCRUM_CHECK(expert_idx >= 0, "expert weights: expert {} must be >= 0", expert_idx);
  return expert_weight_scale(tensor, hidden_size, moe_intermediate_size) / 448.0f * (1.0f + 0.25f * (expert_idx % 4));
}

std::vector<uint16_t> expert_weights_reference(uint64_t seed, int layer_idx, int expert_idx, ExpertTensor tensor,
                                               int hidden_size, int moe_intermediate_size) {
  const int64_t h_times_i = int64_t{hidden_size} * moe_intermediate_size;
  const int64_t n = tensor == ExpertTensor::kGateUp ? 2 * h_times_i : h_times_i;  // [2I, H] or [H, I]
  return random_bf16_reference(n, expert_weight_seed(seed, layer_idx, expert_idx, tensor),
                               expert_weight_scale(tensor, hidden_size, moe_intermediate_size));
}

}  // namespace fulcrum::model
