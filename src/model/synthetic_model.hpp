#pragma once
// Random Qwen3-MoE checkpoints of a known shape: presets (config.json, hub convention) and
// deterministic weights in the per-expert HF key layout, for tests, benchmarks and EPLB experiments.
//
// Weights are a pure function of (seed, tensor name): each tensor draws from its own Rng stream, so any
// tensor can be regenerated alone, and the values do not depend on dtype, sharding or write order (bf16
// stores the fp32 values rounded to nearest even).
//
// Hidden dimension 0 is the BIAS CHANNEL: every embedding row holds kBiasChannelValue there, no
// attention or MLP output writes it (row 0 of o_proj / down_proj is zero) and no projection other than
// the router reads it (column 0 of q/k/v/gate/up/lm_head is zero); the norms keep weight 1 there. After
// RMSNorm the channel is a positive per-token scalar r_t, so router column 0 (mlp.gate.weight[:, 0])
// acts as a per-expert logit bias r_t * b_e. Qwen3's router has no bias term; this is how router skew
// (router_skew.hpp) steers routing. Router columns 1.. are centred over experts, so the mean router
// logit of a token is r_t * mean_e(b_e): with b_e = kRouterBiasBase + delta_e (delta centred) it reveals r_t.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/checkpoint_writer.hpp"
#include "model/qwen3_config.hpp"

namespace fulcrum::model {

inline constexpr int kBiasChannel = 0;
inline constexpr float kBiasChannelValue = 1.0f;
inline constexpr float kRouterBiasBase = 1.0f;

struct PresetOverrides {
  int num_hidden_layers = 0;  // 0: the preset's
  int num_experts = 0;        // 0: the preset's (num_experts_per_tok becomes min(top-k, experts))
  Dtype dtype = Dtype::kBF16; // written as torch_dtype
  int vocab_size = 0;         // 0: the preset's (e.g. sized to a tokenizer's id bound)
};

// The config.json of a preset (HF key names, hub convention: num_experts, rope_theta).
// Throws a one-line error for an unknown preset or out-of-range overrides.
nlohmann::json preset_config_json(const std::string& preset, const PresetOverrides& overrides);
// True for the presets of real models, whose full size does not fit a laptop.
bool is_large_preset(const std::string& preset);

// Every tensor the model loader expects for `config`, in model order (embedding, layers, norm, head).
std::vector<TensorSpec> synthetic_tensor_specs(const Qwen3MoeConfig& config);

// Produces the weights of synthetic_tensor_specs. `router_bias[k]` (optional, per MoE layer ordinal k,
// [num_experts]) replaces the default zero delta of router column 0: b_e = kRouterBiasBase + delta_e.
class SyntheticWeights {
 public:
  SyntheticWeights(const Qwen3MoeConfig& config, uint64_t seed,
                   std::map<int, std::vector<float>> router_bias = {});
  void produce(const TensorSpec& spec, const std::function<void(std::span<const float>)>& emit) const;

 private:
  Qwen3MoeConfig config_;
  uint64_t seed_;
  std::map<int, std::vector<float>> router_bias_;
};

}  // namespace fulcrum::model
