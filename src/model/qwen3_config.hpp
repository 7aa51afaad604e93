#pragma once
// Qwen3-MoE hyper-parameters, read from a Hugging Face config.json.
// Both conventions are accepted: the hub's (num_experts, rope_theta) and the newer transformers one
// (num_local_experts, rope_parameters.rope_theta). Field names keep the HF keys.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fulcrum::model {

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

  // Layer i is MoE iff it is not in mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0.
  bool is_moe_layer(int layer_idx) const;
  // Decoder-layer indices of all MoE layers of the model, ascending (the k-th entry is "MoE layer k").
  std::vector<int> moe_layer_indices() const;
  // Ordinal of a MoE layer among all MoE layers (its row in a Placement / load matrix), or -1 if dense.
  int moe_layer_ordinal(int layer_idx) const;
};

// Validates and converts a parsed config; errors are one-line fulcrum::Error "origin: key: problem".
Qwen3MoeConfig parse_qwen3_moe_config(const nlohmann::json& json, const std::string& origin);

// Reads `path` (a config.json file) or `path`/config.json when `path` is a folder.
Qwen3MoeConfig load_qwen3_moe_config(const std::string& path);

}  // namespace fulcrum::model
