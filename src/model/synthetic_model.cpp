#include "model/synthetic_model.hpp"

#include <cmath>

#include "eplb/error.hpp"
#include "model/rng.hpp"

namespace fulcrum::model {
namespace {

// Shapes of the real models, from their Hugging Face config.json (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B;
// copies in ../shared/data/configs, checked by tests/make_model_test.cpp). "tiny" matches the golden
// fixtures' scale (hidden 64, head_dim 16, moe_intermediate 16, 128 experts, top-8, vocab 256).
struct Preset {
  const char* name;
  int hidden_size, intermediate_size, moe_intermediate_size, num_hidden_layers;
  int num_attention_heads, num_key_value_heads, head_dim, num_experts, num_experts_per_tok, vocab_size;
  int max_position_embeddings;
  nlohmann::json bos_token_id, eos_token_id;
  bool large;
};

const std::vector<Preset>& presets() {
  static const std::vector<Preset> all = {
      {"tiny", 64, 128, 16, 4, 4, 2, 16, 128, 8, 256, 512, nullptr, nullptr, false},
      {"qwen3-30b-a3b", 2048, 6144, 768, 48, 32, 4, 128, 128, 8, 151936, 40960, 151643, 151645, true},
      {"qwen3-235b-a22b", 4096, 12288, 1536, 94, 64, 4, 128, 128, 8, 151936, 40960, 151643, 151645, true},
  };
  return all;
}

const Preset& find_preset(const std::string& name) {
  std::string known;
  for (const Preset& p : presets()) {
    if (name == p.name) return p;
    known += (known.empty() ? "" : ", ") + std::string(p.name);
  }
  throw Error(fmt::format("unknown preset '{}' (known: {})", name, known));
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

int layer_of(const std::string& name) {
  constexpr std::string_view prefix = "model.layers.";
  if (name.rfind(prefix, 0) != 0) return -1;
  return std::stoi(name.substr(prefix.size()));
}

}  // namespace

bool is_large_preset(const std::string& preset) { return find_preset(preset).large; }

nlohmann::json preset_config_json(const std::string& preset, const PresetOverrides& overrides) {
  const Preset& p = find_preset(preset);
  FULCRUM_CHECK(overrides.num_hidden_layers >= 0 && overrides.num_hidden_layers <= 1024,
                "--layers must be in [1, 1024], got {}", overrides.num_hidden_layers);
  FULCRUM_CHECK(overrides.num_experts >= 0 && overrides.num_experts <= 4096, "--experts must be in [1, 4096], got {}",
                overrides.num_experts);
  FULCRUM_CHECK(overrides.dtype == Dtype::kBF16 || overrides.dtype == Dtype::kF32, "dtype must be bf16 or fp32");
  const int layers = overrides.num_hidden_layers > 0 ? overrides.num_hidden_layers : p.num_hidden_layers;
  const int experts = overrides.num_experts > 0 ? overrides.num_experts : p.num_experts;
  FULCRUM_CHECK(overrides.vocab_size >= 0 && overrides.vocab_size <= (1 << 22), "--vocab-size must be in [1, 4194304], got {}",
                overrides.vocab_size);
  const int vocab_size = overrides.vocab_size > 0 ? overrides.vocab_size : p.vocab_size;
  return nlohmann::json{
      {"architectures", {"Qwen3MoeForCausalLM"}},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"bos_token_id", p.bos_token_id},
      {"decoder_sparse_step", 1},
      {"eos_token_id", p.eos_token_id},
      {"head_dim", p.head_dim},
      {"hidden_act", "silu"},
      {"hidden_size", p.hidden_size},
      {"initializer_range", 0.02},
      {"intermediate_size", p.intermediate_size},
      {"max_position_embeddings", p.max_position_embeddings},
      {"max_window_layers", layers},
      {"mlp_only_layers", nlohmann::json::array()},
      {"model_type", "qwen3_moe"},
      {"moe_intermediate_size", p.moe_intermediate_size},
      {"norm_topk_prob", true},
      {"num_attention_heads", p.num_attention_heads},
      {"num_experts", experts},
      {"num_experts_per_tok", std::min(p.num_experts_per_tok, experts)},
      {"num_hidden_layers", layers},
      {"num_key_value_heads", p.num_key_value_heads},
      {"output_router_logits", false},
      {"rms_norm_eps", 1e-06},
      {"rope_scaling", nullptr},
      {"rope_theta", 1000000.0},
      {"router_aux_loss_coef", 0.001},
      {"sliding_window", nullptr},
      {"tie_word_embeddings", false},
      {"torch_dtype", overrides.dtype == Dtype::kBF16 ? "bfloat16" : "float32"},
      {"transformers_version", "4.51.0"},
      {"use_cache", true},
      {"use_sliding_window", false},
      {"vocab_size", vocab_size},
  };
}

std::vector<TensorSpec> synthetic_tensor_specs(const Qwen3MoeConfig& c) {
  const int64_t hidden = c.hidden_size, head_dim = c.head_dim;
  const int64_t q_width = int64_t{c.num_attention_heads} * head_dim, kv_width = int64_t{c.num_key_value_heads} * head_dim;
  std::vector<TensorSpec> specs = {{"model.embed_tokens.weight", {c.vocab_size, hidden}}};
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    specs.push_back({p + "input_layernorm.weight", {hidden}});
    specs.push_back({p + "self_attn.q_proj.weight", {q_width, hidden}});
    specs.push_back({p + "self_attn.k_proj.weight", {kv_width, hidden}});
    specs.push_back({p + "self_attn.v_proj.weight", {kv_width, hidden}});
    specs.push_back({p + "self_attn.o_proj.weight", {hidden, q_width}});
    specs.push_back({p + "self_attn.q_norm.weight", {head_dim}});
    specs.push_back({p + "self_attn.k_norm.weight", {head_dim}});
    specs.push_back({p + "post_attention_layernorm.weight", {hidden}});
    if (c.is_moe_layer(i)) {
      const int64_t width = c.moe_intermediate_size;
      specs.push_back({p + "mlp.gate.weight", {c.num_experts, hidden}});
      for (int e = 0; e < c.num_experts; ++e) {
        const std::string ep = fmt::format("{}mlp.experts.{}.", p, e);
        specs.push_back({ep + "gate_proj.weight", {width, hidden}});
        specs.push_back({ep + "up_proj.weight", {width, hidden}});
        specs.push_back({ep + "down_proj.weight", {hidden, width}});
      }
    } else {
      const int64_t width = c.intermediate_size;
      specs.push_back({p + "mlp.gate_proj.weight", {width, hidden}});
      specs.push_back({p + "mlp.up_proj.weight", {width, hidden}});
      specs.push_back({p + "mlp.down_proj.weight", {hidden, width}});
    }
  }
  specs.push_back({"model.norm.weight", {hidden}});
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, hidden}});
  return specs;
}

SyntheticWeights::SyntheticWeights(const Qwen3MoeConfig& config, uint64_t seed,
                                   std::map<int, std::vector<float>> router_bias)
    : config_(config), seed_(seed), router_bias_(std::move(router_bias)) {
  for (const auto& [moe_layer, bias] : router_bias_) {
    FULCRUM_CHECK(bias.size() == static_cast<size_t>(config.num_experts), "router bias of MoE layer {}: {} values for {} experts",
                  moe_layer, bias.size(), config.num_experts);
  }
}

void SyntheticWeights::produce(const TensorSpec& spec, const std::function<void(std::span<const float>)>& emit) const {
  const std::string& name = spec.name;
  Rng rng(seed_, name);
  const int64_t rows = spec.shape[0], cols = spec.shape.size() > 1 ? spec.shape[1] : 1;
  const double residual_scale = 1.0 / std::sqrt(2.0 * config_.num_hidden_layers);  // keeps the residual stream bounded

  if (spec.shape.size() == 1) {  // RMSNorm weights: 1 + N(0, 0.1); hidden-size norms keep the bias channel at 1
    std::vector<float> w(static_cast<size_t>(rows));  // [dim]
    for (float& v : w) v = static_cast<float>(1.0 + 0.1 * rng.normal());
    if (!ends_with(name, "q_norm.weight") && !ends_with(name, "k_norm.weight")) w[kBiasChannel] = 1.0f;
    emit(w);
    return;
  }
  if (ends_with(name, "mlp.gate.weight")) {  // router [num_experts, hidden]
    std::vector<float> w(static_cast<size_t>(rows * cols));
    const double std = 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(cols - 1, 1)));
    for (float& v : w) v = static_cast<float>(std * rng.normal());
    for (int64_t j = 0; j < cols; ++j) {  // centre every column over the experts
      double mean = 0;
      for (int64_t e = 0; e < rows; ++e) mean += w[e * cols + j];
      mean /= static_cast<double>(rows);
      for (int64_t e = 0; e < rows; ++e) w[e * cols + j] = static_cast<float>(w[e * cols + j] - mean);
    }
    const auto bias = router_bias_.find(config_.moe_layer_ordinal(layer_of(name)));
    for (int64_t e = 0; e < rows; ++e) {
      w[e * cols + kBiasChannel] = kRouterBiasBase + (bias == router_bias_.end() ? 0.0f : bias->second[e]);
    }
    emit(w);
    return;
  }
  // Matrices [rows, cols], uniform with the given standard deviation (cheap for multi-GiB slices; only the
  // router, above, is Gaussian, since its tails shape routing). What reads the bias channel (a column) or writes it (a row) is zeroed there.
  const bool embedding = name == "model.embed_tokens.weight";
  const bool writes_residual = ends_with(name, "o_proj.weight") || ends_with(name, "down_proj.weight");
  const double std = embedding ? 1.0 : (writes_residual ? residual_scale : 1.0) / std::sqrt(static_cast<double>(cols));
  std::vector<float> chunk;
  const int64_t rows_per_chunk = std::max<int64_t>(1, (1 << 16) / cols);
  for (int64_t row = 0; row < rows; row += rows_per_chunk) {
    const int64_t count = std::min(rows_per_chunk, rows - row);
    chunk.resize(static_cast<size_t>(count * cols));  // [count, cols]
    for (float& v : chunk) v = static_cast<float>(std * rng.unit_uniform());
    for (int64_t r = 0; r < count; ++r) {
      if (embedding) {
        chunk[r * cols + kBiasChannel] = kBiasChannelValue;
      } else if (!writes_residual) {
        chunk[r * cols + kBiasChannel] = 0.0f;
      } else if (row + r == kBiasChannel) {
        std::fill_n(chunk.begin() + r * cols, cols, 0.0f);
      }
    }
    emit(chunk);
  }
}

}  // namespace fulcrum::model
