// Qwen3MoeModel::load_weights: checkpoint tensors (HF names, per-expert layout) into this stage's tensors.
#include <algorithm>
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

// Reads rows [row_begin, +dst.dim(0)) of checkpoint tensor `name` (shape `shape`, 2-D) into `dst`.
void read_rows_into(Backend& backend, Checkpoint& checkpoint, const std::string& name,
                    const std::vector<int64_t>& shape, int64_t row_begin, const Tensor& dst) {
  FULCRUM_CHECK(checkpoint.contains(name), "{}: missing tensor '{}'", checkpoint.dir(), name);
  std::vector<float> host(static_cast<size_t>(dst.numel()));
  checkpoint.read_f32_block_into(name, shape, row_begin, dst.dim(0), 0, shape[1], host);
  backend.upload(dst, host);
}

// Reads columns [col_begin, +dst.dim(1)) of checkpoint tensor `name` (shape `shape`, 2-D) into `dst`.
void read_cols_into(Backend& backend, Checkpoint& checkpoint, const std::string& name,
                    const std::vector<int64_t>& shape, int64_t col_begin, const Tensor& dst) {
  FULCRUM_CHECK(checkpoint.contains(name), "{}: missing tensor '{}'", checkpoint.dir(), name);
  std::vector<float> host(static_cast<size_t>(dst.numel()));
  checkpoint.read_f32_block_into(name, shape, 0, shape[0], col_begin, dst.dim(1), host);
  backend.upload(dst, host);
}

}  // namespace

void Qwen3MoeModel::load_weights(Checkpoint& checkpoint, const std::function<void(int done, int total)>& on_layer,
                                 const ExpertSlotFilter& read_expert_slot) {
  const std::set<std::string> known = model_tensor_names(config_);
  const std::set<std::string> scales = checked_fp8_scale_names(config_, checkpoint);
  for (const std::string& name : checkpoint.names()) {
    FULCRUM_CHECK(known.count(name) != 0 || scales.count(name) != 0, "{}: unexpected tensor '{}' (not part of a {}-layer Qwen3-MoE of this config)",
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
  const int total = static_cast<int>(layers_.size());
  for (int i = 0; i < total; ++i) {
    load_layer(*layers_[static_cast<size_t>(i)], checkpoint, read_expert_slot);
    if (on_layer) on_layer(i + 1, total);
  }
}

void Qwen3MoeModel::load_layer(Layer& layer, Checkpoint& checkpoint, const ExpertSlotFilter& read_expert_slot) {
  const std::string prefix = layer_prefix(layer.layer_idx);
  const ShardSpec& shard = parallel_.shard;
  const int64_t hidden = config_.hidden_size, head_dim = config_.head_dim;
  read_into(backend_, checkpoint, prefix + "input_layernorm.weight", layer.input_layernorm);
  read_into(backend_, checkpoint, prefix + "post_attention_layernorm.weight", layer.post_attention_layernorm);
  // Query heads [head_begin, +num_local_heads); kv heads sharded alike, or one replicated kv head.
  const int64_t num_heads = config_.num_attention_heads, num_kv_heads = config_.num_key_value_heads;
  const int64_t head_begin = int64_t{shard.attn_tp_rank} * num_local_heads();
  const int64_t kv_begin = num_kv_heads >= shard.attn_tp_size
                               ? int64_t{shard.attn_tp_rank} * num_local_kv_heads()
                               : shard.attn_tp_rank / (shard.attn_tp_size / num_kv_heads);
  read_rows_into(backend_, checkpoint, prefix + "self_attn.q_proj.weight", {num_heads * head_dim, hidden},
                 head_begin * head_dim, layer.q_proj);
  read_rows_into(backend_, checkpoint, prefix + "self_attn.k_proj.weight", {num_kv_heads * head_dim, hidden},
                 kv_begin * head_dim, layer.k_proj);
  read_rows_into(backend_, checkpoint, prefix + "self_attn.v_proj.weight", {num_kv_heads * head_dim, hidden},
                 kv_begin * head_dim, layer.v_proj);
  read_cols_into(backend_, checkpoint, prefix + "self_attn.o_proj.weight", {hidden, num_heads * head_dim},
                 head_begin * head_dim, layer.o_proj);
  read_into(backend_, checkpoint, prefix + "self_attn.q_norm.weight", layer.q_norm);
  read_into(backend_, checkpoint, prefix + "self_attn.k_norm.weight", layer.k_norm);
  if (!layer.is_moe()) {
    const int64_t full = config_.intermediate_size, width = layer.mlp_down.dim(1);  // this rank's slice
    const int64_t begin = int64_t{shard.attn_tp_rank} * width;
    read_rows_into(backend_, checkpoint, prefix + "mlp.gate_proj.weight", {full, hidden}, begin,
                   layer.mlp_gate_up.rows(0, width));
    read_rows_into(backend_, checkpoint, prefix + "mlp.up_proj.weight", {full, hidden}, begin,
                   layer.mlp_gate_up.rows(width, width));
    read_cols_into(backend_, checkpoint, prefix + "mlp.down_proj.weight", {hidden, full}, begin, layer.mlp_down);
    return;
  }
  read_into(backend_, checkpoint, prefix + "mlp.gate.weight", layer.router);
  // Every local slot is filled from the logical expert it holds; replicas read the same tensors again.
  const ExpertSlotView view = slot_view(layer);
  for (int local_slot = 0; local_slot < view.num_slots; ++local_slot) {
    if (read_expert_slot && !read_expert_slot(view.moe_layer_idx, local_slot)) continue;
    load_expert_slot(layer, checkpoint, local_slot, view.physical_to_logical[local_slot]);
  }
  // With EP 1 every logical expert has a slot here, so every expert tensor was read and checked; with
  // EP > 1 each rank checks the experts it holds.
}

void Qwen3MoeModel::load_expert_slot(Layer& layer, Checkpoint& checkpoint, int local_slot, int expert_idx) {
  const int64_t hidden = config_.hidden_size, full = config_.moe_intermediate_size;
  const int64_t width = layer.experts_down.dim(2);  // this rank's slice of moe_intermediate_size
  const int64_t begin = int64_t{parallel_.shard.moe_tp_rank} * width;
  const Tensor gate_up = layer.experts_gate_up.index(local_slot);  // [2w, hidden]
  read_rows_into(backend_, checkpoint, expert_name(layer.layer_idx, expert_idx, "gate_proj"), {full, hidden}, begin,
                 gate_up.rows(0, width));
  read_rows_into(backend_, checkpoint, expert_name(layer.layer_idx, expert_idx, "up_proj"), {full, hidden}, begin,
                 gate_up.rows(width, width));
  read_cols_into(backend_, checkpoint, expert_name(layer.layer_idx, expert_idx, "down_proj"), {hidden, full}, begin,
                 layer.experts_down.index(local_slot));
}

Qwen3MoeModel::Layer& Qwen3MoeModel::checked_moe_layer(int layer_idx, std::span<const int32_t> layer_map) {
  FULCRUM_CHECK(owns_layer(layer_idx) && layers_[layer_idx - start_layer_]->is_moe(),
                "layer map: layer {} is not a MoE layer of this stage [{}, {})", layer_idx, start_layer_, end_layer_);
  Layer& layer = *layers_[layer_idx - start_layer_];
  FULCRUM_CHECK(layer_map.size() == layer.physical_to_logical.size(),
                "layer map: layer {} has {} physical slots, the new map {}", layer_idx, layer.physical_to_logical.size(),
                layer_map.size());
  for (size_t slot_idx = 0; slot_idx < layer_map.size(); ++slot_idx) {
    FULCRUM_CHECK(layer_map[slot_idx] >= 0 && layer_map[slot_idx] < config_.num_experts,
                  "layer map: layer {}: slot {} holds logical expert {}, outside [0, {})", layer_idx, slot_idx,
                  layer_map[slot_idx], config_.num_experts);
  }
  const std::vector<int> counts = eplb::replica_counts(layer_map, config_.num_experts);
  for (int expert_idx = 0; expert_idx < config_.num_experts; ++expert_idx) {
    FULCRUM_CHECK(counts[expert_idx] > 0, "layer map: layer {}: logical expert {} has no physical slot", layer_idx,
                  expert_idx);
  }
  return layer;
}

void Qwen3MoeModel::replace_layer_map(int layer_idx, std::span<const int32_t> layer_map, Checkpoint& checkpoint) {
  Layer& layer = checked_moe_layer(layer_idx, layer_map);
  const ExpertSlotView view = slot_view(layer);
  for (int local_slot = 0; local_slot < view.num_slots; ++local_slot) {
    const int32_t expert_idx = layer_map[view.slot_begin + local_slot];
    if (expert_idx != view.physical_to_logical[local_slot]) load_expert_slot(layer, checkpoint, local_slot, expert_idx);
  }
  std::copy(layer_map.begin(), layer_map.end(), layer.physical_to_logical.begin());
}

void Qwen3MoeModel::set_layer_map(int layer_idx, std::span<const int32_t> layer_map) {
  Layer& layer = checked_moe_layer(layer_idx, layer_map);
  std::copy(layer_map.begin(), layer_map.end(), layer.physical_to_logical.begin());
}

}  // namespace fulcrum::model
