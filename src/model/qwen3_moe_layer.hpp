#pragma once
// The weights of one decoder layer of a stage (internal to the model's .cpp files).
#include <cstdint>
#include <vector>

#include "model/qwen3_moe.hpp"

namespace fulcrum::model {

struct Qwen3MoeModel::Layer {
  int layer_idx = 0;
  int moe_layer_idx = -1;            // -1: dense MLP layer
  Tensor input_layernorm;            // [hidden_size]
  Tensor post_attention_layernorm;   // [hidden_size]
  Tensor q_proj;                     // [num_attention_heads * head_dim, hidden_size]
  Tensor k_proj;                     // [num_key_value_heads * head_dim, hidden_size]
  Tensor v_proj;                     // [num_key_value_heads * head_dim, hidden_size]
  Tensor o_proj;                     // [hidden_size, num_attention_heads * head_dim]
  Tensor q_norm;                     // [head_dim]
  Tensor k_norm;                     // [head_dim]
  // Dense layers.
  Tensor mlp_gate_up;                // [2 * intermediate_size, hidden_size]: gate_proj rows, then up_proj rows
  Tensor mlp_down;                   // [hidden_size, intermediate_size]
  // MoE layers.
  Tensor router;                     // [num_experts, hidden_size] (mlp.gate)
  Tensor experts_gate_up;            // [num_slots, 2 * moe_intermediate_size, hidden_size]
  Tensor experts_down;               // [num_slots, hidden_size, moe_intermediate_size]
  std::vector<int32_t> physical_to_logical;  // [num_slots]

  bool is_moe() const { return moe_layer_idx >= 0; }
};

}  // namespace fulcrum::model
