#pragma once
// Qwen3-MoE hyper-parameters, read from a Hugging Face config.json.
// Both conventions are accepted: the hub's (num_experts, rope_theta) and the newer transformers one
// (num_local_experts, rope_parameters.rope_theta). Field names keep the HF keys.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fulcrum::model {

// config.json `quantization_config` of the real Qwen3-*-FP8 checkpoints, the only form accepted:
// {quant_method: "fp8", fmt: "e4m3", activation_scheme: "dynamic", weight_block_size: [128, 128]}.
// Every linear weight (fp8_weight_names) is then float8_e4m3fn [out, in] with a sibling
// `<weight>_scale_inv` [ceil(out / 128), ceil(in / 128)] (F32 or BF16): W[r][c] = fp8[r][c] *
// scale_inv[r / 128][c / 128]. Router, embeddings, norms and LM head stay unquantized.
struct Fp8BlockQuantization {
  int64_t block_rows = 128;  // weight_block_size[0]: rows (output features) per scale
  int64_t block_cols = 128;  // weight_block_size[1]: columns (input features) per scale
};

// The `quantization_config` object of a parsed config.json; nullopt when absent or null. Anything but the
// form above is a one-line error naming the field ("origin: key 'quantization_config.fmt': ...").
std::optional<Fp8BlockQuantization> parse_quantization_config(const nlohmann::json& root, const std::string& origin);

// Suffix of a weight's scale tensor in an FP8 checkpoint: "x.weight" -> "x.weight_scale_inv".
inline constexpr const char* kScaleInvSuffix = "_scale_inv";

struct Qwen3MoeConfig {
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;      // dense MLP layers (mlp_only_layers, or layers skipped by decoder_sparse_step)
  int moe_intermediate_size = 0;  // each routed expert
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;               // default hidden_size / num_attention_heads
  int num_experts = 0;            // routed (logical) experts per MoE layer; 0 means every layer is dense
  int num_experts_per_tok = 0;    // top-k
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  bool norm_topk_prob = false;
  bool tie_word_embeddings = false;
  float rms_norm_eps = 1e-6f;
  double rope_theta = 10000.0;
  int max_position_embeddings = 0;
  std::optional<Fp8BlockQuantization> quantization;  // set: the checkpoint's linear weights are FP8

  // Layer i is MoE iff it is not in mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0.
  bool is_moe_layer(int layer_idx) const;
  // Decoder-layer indices of all MoE layers of the model, ascending (the k-th entry is "MoE layer k").
  std::vector<int> moe_layer_indices() const;
  // Ordinal of a MoE layer among all MoE layers (its row in a Placement / load matrix), or -1 if dense.
  int moe_layer_ordinal(int layer_idx) const;
};

// Names of the model's linear weights that an FP8 checkpoint stores as float8_e4m3fn: per layer
// self_attn.{q,k,v,o}_proj.weight, and mlp.{gate,up,down}_proj.weight (dense layers) or
// mlp.experts.{e}.{gate,up,down}_proj.weight (MoE layers); never the router, norms, embeddings, LM head.
std::vector<std::string> fp8_weight_names(const Qwen3MoeConfig& config);
// The scale tensors an FP8 checkpoint of `config` holds (`<weight>_scale_inv` of every fp8_weight_names
// entry); empty when the config is not quantized. What the loaders accept beside the model's tensors.
std::vector<std::string> fp8_scale_names(const Qwen3MoeConfig& config);

// Validates and converts a parsed config; errors are one-line fulcrum::Error "origin: key: problem".
Qwen3MoeConfig parse_qwen3_moe_config(const nlohmann::json& json, const std::string& origin);

// Reads `path` (a config.json file) or `path`/config.json when `path` is a folder.
Qwen3MoeConfig load_qwen3_moe_config(const std::string& path);

// One line naming every field the weights' shapes and layout depend on (and FP8 dequantization): what a weight
// cache written for this config records, so that a cache of another model is refused.
std::string weight_cache_config_identity(const Qwen3MoeConfig& config);

}  // namespace fulcrum::model
