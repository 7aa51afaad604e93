// Qwen3MoeModel::load_weights: checkpoint tensors (HF names, per-expert layout) into this stage's tensors.
#include <set>

#include "eplb/error.hpp"
#include "model/qwen3_moe.hpp"
#include "model/qwen3_moe_layer.hpp"

namespace fulcrum::model {
namespace {

std::string layer_prefix(int layer_idx) { return fmt::format("model.layers.{}.", layer_idx); }

std::string expert_name(int layer_idx, int expert_idx, const char* proj) {
  return fmt::format("model.layers.{}.mlp.experts.{}.{}.weight", layer_idx, expert_idx, proj);
}

// Every tensor name of the whole model (all stages), as HF writes a Qwen3-MoE checkpoint.
std::set<std::string> model_tensor_names(const Qwen3MoeConfig& config) {
  std::set<std::string> names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"};
  for (int layer_idx = 0; layer_idx < config.num_hidden_layers; ++layer_idx) {
    const std::string prefix = layer_prefix(layer_idx);
    for (const char* name : {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                             "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                             "self_attn.q_norm.weight", "self_attn.k_norm.weight"}) {
      names.insert(prefix + name);
    }
    if (config.is_moe_layer(layer_idx)) {
      names.insert(prefix + "mlp.gate.weight");
      for (int expert_idx = 0; expert_idx < config.num_experts; ++expert_idx) {
        for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) names.insert(expert_name(layer_idx, expert_idx, proj));
      }
    } else {
      for (const char* name : {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}) {
        names.insert(prefix + name);
      }
    }
  }
  return names;
}

// Reads checkpoint tensor `name` (its shape must be `shape`) into `dst` (same element count).
void read_into(Backend& backend, Checkpoint& checkpoint, const std::string& name, const std::vector<int64_t>& shape,
               const Tensor& dst) {
  FULCRUM_CHECK(checkpoint.contains(name), "{}: missing tensor '{}'", checkpoint.dir(), name);
  std::vector<float> host(static_cast<size_t>(dst.numel()));
  checkpoint.read_f32_into(name, shape, host);
  backend.upload(dst, host);
}

void read_into(Backend& backend, Checkpoint& checkpoint, const std::string& name, const Tensor& dst) {
  read_into(backend, checkpoint, name, dst.shape(), dst);
}

}  // namespace

void Qwen3MoeModel::load_weights(Checkpoint& checkpoint) {
  const std::set<std::string> known = model_tensor_names(config_);
  for (const std::string& name : checkpoint.names()) {
    FULCRUM_CHECK(known.count(name) != 0, "{}: unexpected tensor '{}' (not part of a {}-layer Qwen3-MoE of this config)",
                  checkpoint.file_of(name), name, config_.num_hidden_layers);
  }
  if (is_first_stage()) read_into(backend_, checkpoint, "model.embed_tokens.weight", embed_tokens_);
  if (is_last_stage()) {
    read_into(backend_, checkpoint, "model.norm.weight", norm_);
    if (!config_.tie_word_embeddings) {
      read_into(backend_, checkpoint, "lm_head.weight", lm_head_);
    } else if (!is_first_stage()) {
      read_into(backend_, checkpoint, "model.embed_tokens.weight", lm_head_);
    }
  }
  for (const auto& layer : layers_) load_layer(*layer, checkpoint);
}

void Qwen3MoeModel::load_layer(Layer& layer, Checkpoint& checkpoint) {
  const std::string prefix = layer_prefix(layer.layer_idx);
  read_into(backend_, checkpoint, prefix + "input_layernorm.weight", layer.input_layernorm);
  read_into(backend_, checkpoint, prefix + "post_attention_layernorm.weight", layer.post_attention_layernorm);
  read_into(backend_, checkpoint, prefix + "self_attn.q_proj.weight", layer.q_proj);
  read_into(backend_, checkpoint, prefix + "self_attn.k_proj.weight", layer.k_proj);
  read_into(backend_, checkpoint, prefix + "self_attn.v_proj.weight", layer.v_proj);
  read_into(backend_, checkpoint, prefix + "self_attn.o_proj.weight", layer.o_proj);
  read_into(backend_, checkpoint, prefix + "self_attn.q_norm.weight", layer.q_norm);
  read_into(backend_, checkpoint, prefix + "self_attn.k_norm.weight", layer.k_norm);
  const int64_t hidden = config_.hidden_size;
  if (!layer.is_moe()) {
    const int64_t width = config_.intermediate_size;
    read_into(backend_, checkpoint, prefix + "mlp.gate_proj.weight", layer.mlp_gate_up.rows(0, width));
    read_into(backend_, checkpoint, prefix + "mlp.up_proj.weight", layer.mlp_gate_up.rows(width, width));
    read_into(backend_, checkpoint, prefix + "mlp.down_proj.weight", layer.mlp_down);
    return;
  }
  read_into(backend_, checkpoint, prefix + "mlp.gate.weight", layer.router);
  const int64_t width = config_.moe_intermediate_size;
  // Every slot is filled from the logical expert it holds; replicas read the same tensors again.
  for (size_t slot_idx = 0; slot_idx < layer.physical_to_logical.size(); ++slot_idx) {
    const int expert_idx = layer.physical_to_logical[slot_idx];
    const Tensor gate_up = layer.experts_gate_up.index(static_cast<int64_t>(slot_idx));  // [2I, hidden]
    read_into(backend_, checkpoint, expert_name(layer.layer_idx, expert_idx, "gate_proj"), {width, hidden},
              gate_up.rows(0, width));
    read_into(backend_, checkpoint, expert_name(layer.layer_idx, expert_idx, "up_proj"), {width, hidden},
              gate_up.rows(width, width));
    read_into(backend_, checkpoint, expert_name(layer.layer_idx, expert_idx, "down_proj"), {hidden, width},
              layer.experts_down.index(static_cast<int64_t>(slot_idx)));
  }
  // The placement guarantees every logical expert a slot, so every expert tensor was read and checked.
}

}  // namespace fulcrum::model
