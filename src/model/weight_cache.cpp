// Qwen3MoeModel's weight cache. One safetensors file per stage and rank holding every tensor the model
// object holds, under names of its own ("layers.{i}.experts_gate_up", ...), and in its metadata what the
// file was written for: config, stage, shard and each owned MoE layer's slot map. Loading reads the
// tensors whole into the model's existing tensors, bypassing the per-logical-expert path of load_weights;
// EPLB's view of the expert slots (expert_slot_views) is the one built at construction in both cases,
// which is what the upstream bug this guards against got wrong.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "eplb/error.hpp"
#include "model/qwen3_moe.hpp"
#include "model/qwen3_moe_layer.hpp"

namespace fulcrum::model {
namespace {

constexpr const char* kFormat = "fulcrum-weight-cache-1";

}  // namespace

std::vector<std::pair<std::string, Tensor>> Qwen3MoeModel::named_tensors() {
  std::vector<std::pair<std::string, Tensor>> named;
  if (is_first_stage()) named.emplace_back("embed_tokens", embed_tokens_);
  if (is_last_stage()) {
    named.emplace_back("norm", norm_);
    if (!config_.tie_word_embeddings || !is_first_stage()) named.emplace_back("lm_head", lm_head_);
  }
  for (const auto& layer : layers_) {
    const std::string prefix = fmt::format("layers.{}.", layer->layer_idx);
    for (auto [name, tensor] : {std::pair{"input_layernorm", layer->input_layernorm},
                                {"post_attention_layernorm", layer->post_attention_layernorm},
                                {"q_proj", layer->q_proj}, {"k_proj", layer->k_proj}, {"v_proj", layer->v_proj},
                                {"o_proj", layer->o_proj}, {"q_norm", layer->q_norm}, {"k_norm", layer->k_norm}}) {
      named.emplace_back(prefix + name, tensor);
    }
    if (layer->is_moe()) {
      named.emplace_back(prefix + "router", layer->router);
      named.emplace_back(prefix + "experts_gate_up", layer->experts_gate_up);
      named.emplace_back(prefix + "experts_down", layer->experts_down);
    } else {
      named.emplace_back(prefix + "mlp_gate_up", layer->mlp_gate_up);
      named.emplace_back(prefix + "mlp_down", layer->mlp_down);
    }
  }
  return named;
}

std::map<std::string, std::string> Qwen3MoeModel::weight_cache_identity() {
  const Qwen3MoeConfig& c = config_;
  const ShardSpec& s = parallel_.shard;
  std::map<std::string, std::string> identity = {
      {"format", kFormat},
      {"config", weight_cache_config_identity(c)},
      {"stage", fmt::format("[{}, {})", start_layer_, end_layer_)},
      {"shard", fmt::format("attn_tp {}/{} ep {}/{} moe_tp {}/{}", s.attn_tp_rank, s.attn_tp_size, s.ep_rank,
                            s.ep_size, s.moe_tp_rank, s.moe_tp_size)}};
  for (const auto& layer : layers_) {
    if (layer->is_moe()) {
      identity[fmt::format("slot_map.{}", layer->layer_idx)] = fmt::format("{}", fmt::join(layer->physical_to_logical, " "));
    }
  }
  return identity;
}

void Qwen3MoeModel::save_weight_cache(const std::string& path) {
  std::map<std::string, HostTensor> tensors;
  for (const auto& [name, tensor] : named_tensors()) tensors[name] = HostTensor{tensor.shape(), backend_.download(tensor)};
  write_safetensors(path, tensors, weight_cache_identity());
}

void Qwen3MoeModel::load_weight_cache(const std::string& path) {
  const SafetensorsFile file(path);
  for (const auto& [key, expected] : weight_cache_identity()) {
    const auto found = file.metadata().find(key);
    FULCRUM_CHECK(found != file.metadata().end() && found->second == expected,
                  "{}: weight cache written for another {} ({}; this model: {}): delete it to rebuild it", path, key,
                  found == file.metadata().end() ? std::string("missing") : found->second, expected);
  }
  const auto named = named_tensors();
  FULCRUM_CHECK(file.names().size() == named.size(), "{}: weight cache holds {} tensors, this model {}", path,
                file.names().size(), named.size());
  std::vector<float> host;
  for (const auto& [name, tensor] : named) {
    const TensorInfo& info = file.info(name);
    FULCRUM_CHECK(info.shape == tensor.shape(), "{}: tensor '{}' has shape {}, expected {}", path, name,
                  shape_text(info.shape), shape_text(tensor.shape()));
    host.resize(static_cast<size_t>(tensor.numel()));
    file.read_f32_into(name, host);
    backend_.upload(tensor, host);
  }
}

}  // namespace fulcrum::model
