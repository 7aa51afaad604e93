#include "model/qwen3_config.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "eplb/error.hpp"
#include "eplb/json_text.hpp"

namespace fulcrum::model {
namespace {

using nlohmann::json;

// Reads config keys, naming the file and key in every error.
class ConfigReader {
 public:
  ConfigReader(const json& root, const std::string& origin) : root_(root), origin_(origin) {
    FULCRUM_CHECK(root.is_object(), "{}: config must be a JSON object", origin);
  }

  bool has(const std::string& key) const { return root_.contains(key) && !root_.at(key).is_null(); }

  const json& at(const std::string& key) const {
    FULCRUM_CHECK(has(key), "{}: missing key '{}'", origin_, key);
    return root_.at(key);
  }

  int integer(const std::string& key) const {
    const json& value = at(key);
    FULCRUM_CHECK(value.is_number_integer(), "{}: key '{}' must be an integer, got {}", origin_, key, eplb::json_excerpt(value));
    const int64_t v = value.get<int64_t>();
    FULCRUM_CHECK(v >= INT32_MIN && v <= INT32_MAX, "{}: key '{}' out of range: {}", origin_, key, v);
    return static_cast<int>(v);
  }

  int positive(const std::string& key) const {
    const int v = integer(key);
    FULCRUM_CHECK(v > 0, "{}: key '{}' must be positive, got {}", origin_, key, v);
    return v;
  }

  double number(const json& value, const std::string& key) const {
    FULCRUM_CHECK(value.is_number(), "{}: key '{}' must be a number, got {}", origin_, key, eplb::json_excerpt(value));
    return value.get<double>();
  }

  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& value = root_.at(key);
    FULCRUM_CHECK(value.is_boolean(), "{}: key '{}' must be true or false, got {}", origin_, key, eplb::json_excerpt(value));
    return value.get<bool>();
  }

  std::string text(const std::string& key) const {
    const json& value = at(key);
    FULCRUM_CHECK(value.is_string(), "{}: key '{}' must be a string, got {}", origin_, key, eplb::json_excerpt(value));
    return value.get<std::string>();
  }

  const std::string& origin() const { return origin_; }

 private:
  const json& root_;
  std::string origin_;
};

// Number of routed experts: num_experts (hub) or num_local_experts (newer transformers); both must agree.
int read_num_experts(const ConfigReader& reader) {
  const bool has_hub = reader.has("num_experts");
  const bool has_local = reader.has("num_local_experts");
  FULCRUM_CHECK(has_hub || has_local, "{}: missing key 'num_experts' (or 'num_local_experts')", reader.origin());
  const int hub = has_hub ? reader.integer("num_experts") : -1;
  const int local = has_local ? reader.integer("num_local_experts") : -1;
  FULCRUM_CHECK(!(has_hub && has_local) || hub == local,
                "{}: keys 'num_experts' ({}) and 'num_local_experts' ({}) disagree", reader.origin(), hub, local);
  const int value = has_hub ? hub : local;
  FULCRUM_CHECK(value >= 0, "{}: key '{}' must not be negative, got {}", reader.origin(),
                has_hub ? "num_experts" : "num_local_experts", value);
  return value;
}

// rope_theta (hub) or rope_parameters.rope_theta with rope_type "default" (newer transformers).
double read_rope_theta(const ConfigReader& reader, const json& root) {
  const std::string& origin = reader.origin();
  if (reader.has("rope_scaling")) {  // hub convention: null, or an object whose type must be "default"
    const json& scaling = root.at("rope_scaling");
    const char* type_key = scaling.is_object() && scaling.contains("rope_type") ? "rope_type" : "type";
    const bool is_default = scaling.is_object() && scaling.contains(type_key) && scaling[type_key].is_string() &&
                            scaling[type_key].get<std::string>() == "default";
    FULCRUM_CHECK(is_default, "{}: key 'rope_scaling': unsupported rope scaling {} (only rope_type \"default\")",
                  origin, eplb::json_excerpt(scaling));
  }
  std::optional<double> theta;
  if (reader.has("rope_parameters")) {
    const json& params = root.at("rope_parameters");
    FULCRUM_CHECK(params.is_object(), "{}: key 'rope_parameters' must be an object", origin);
    if (params.contains("rope_type") && !params["rope_type"].is_null()) {
      const json& type = params["rope_type"];
      FULCRUM_CHECK(type.is_string() && type.get<std::string>() == "default",
                    "{}: key 'rope_parameters.rope_type': unsupported rope type {} (only \"default\")", origin,
                    eplb::json_excerpt(type));
    }
    if (params.contains("rope_theta") && !params["rope_theta"].is_null()) {
      theta = reader.number(params["rope_theta"], "rope_parameters.rope_theta");
    }
  }
  if (reader.has("rope_theta")) {
    const double top = reader.number(root.at("rope_theta"), "rope_theta");
    FULCRUM_CHECK(!theta || *theta == top, "{}: keys 'rope_theta' ({}) and 'rope_parameters.rope_theta' ({}) disagree",
                  origin, top, *theta);
    theta = top;
  }
  FULCRUM_CHECK(theta.has_value(), "{}: missing key 'rope_theta' (or 'rope_parameters.rope_theta')", origin);
  FULCRUM_CHECK(*theta > 0, "{}: key 'rope_theta' must be positive, got {}", origin, *theta);
  return *theta;
}

}  // namespace

std::optional<Fp8BlockQuantization> parse_quantization_config(const json& root, const std::string& origin) {
  FULCRUM_CHECK(root.is_object(), "{}: config must be a JSON object", origin);
  if (!root.contains("quantization_config") || root["quantization_config"].is_null()) return std::nullopt;
  const json& q = root["quantization_config"];
  FULCRUM_CHECK(q.is_object(), "{}: key 'quantization_config' must be an object, got {}", origin,
                eplb::json_excerpt(q));
  // quant_method, fmt and activation_scheme: exactly the strings of the Qwen3-*-FP8 checkpoints.
  for (const auto& [key, expected] : {std::pair{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"}}) {
    FULCRUM_CHECK(q.contains(key), "{}: missing key 'quantization_config.{}' (expected \"{}\")", origin, key, expected);
    FULCRUM_CHECK(q[key].is_string() && q[key].get<std::string>() == expected,
                  "{}: key 'quantization_config.{}': unsupported value {} (only \"{}\")", origin, key,
                  eplb::json_excerpt(q[key]), expected);
  }
  FULCRUM_CHECK(q.contains("weight_block_size"), "{}: missing key 'quantization_config.weight_block_size'", origin);
  const json& block = q["weight_block_size"];
  FULCRUM_CHECK(block.is_array() && block.size() == 2 && block[0].is_number_integer() && block[1].is_number_integer() &&
                    block[0].get<int64_t>() == 128 && block[1].get<int64_t>() == 128,
                "{}: key 'quantization_config.weight_block_size': unsupported block size {} (only [128, 128])", origin,
                eplb::json_excerpt(block));
  return Fp8BlockQuantization{128, 128};
}

std::vector<std::string> fp8_weight_names(const Qwen3MoeConfig& config) {
  std::vector<std::string> names;
  for (int layer_idx = 0; layer_idx < config.num_hidden_layers; ++layer_idx) {
    const std::string prefix = "model.layers." + std::to_string(layer_idx) + ".";
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"}) names.push_back(prefix + "self_attn." + proj + ".weight");
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      if (!config.is_moe_layer(layer_idx)) {
        names.push_back(prefix + "mlp." + proj + ".weight");
        continue;
      }
      for (int expert_idx = 0; expert_idx < config.num_experts; ++expert_idx) {
        names.push_back(prefix + "mlp.experts." + std::to_string(expert_idx) + "." + proj + ".weight");
      }
    }
  }
  return names;
}

std::vector<std::string> fp8_scale_names(const Qwen3MoeConfig& config) {
  std::vector<std::string> names;
  if (!config.quantization) return names;
  for (const std::string& weight : fp8_weight_names(config)) names.push_back(weight + kScaleInvSuffix);
  return names;
}

bool Qwen3MoeConfig::is_moe_layer(int layer_idx) const {
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer_idx) != mlp_only_layers.end()) return false;
  return (layer_idx + 1) % decoder_sparse_step == 0;
}

std::vector<int> Qwen3MoeConfig::moe_layer_indices() const {
  std::vector<int> indices;
  for (int layer_idx = 0; layer_idx < num_hidden_layers; ++layer_idx) {
    if (is_moe_layer(layer_idx)) indices.push_back(layer_idx);
  }
  return indices;
}

int Qwen3MoeConfig::moe_layer_ordinal(int layer_idx) const {
  if (!is_moe_layer(layer_idx)) return -1;
  int ordinal = 0;
  for (int i = 0; i < layer_idx; ++i) ordinal += is_moe_layer(i) ? 1 : 0;
  return ordinal;
}

Qwen3MoeConfig parse_qwen3_moe_config(const json& root, const std::string& origin) {
  const ConfigReader reader(root, origin);
  const std::string model_type = reader.text("model_type");
  FULCRUM_CHECK(model_type == "qwen3_moe", "{}: key 'model_type': unsupported model type '{}' (expected qwen3_moe)",
                origin, eplb::printable_excerpt(model_type));
  if (reader.has("hidden_act")) {
    const std::string act = reader.text("hidden_act");
    FULCRUM_CHECK(act == "silu", "{}: key 'hidden_act': unsupported activation '{}' (only silu)", origin,
                  eplb::printable_excerpt(act));
  }
  FULCRUM_CHECK(!reader.boolean("use_sliding_window", false),
                "{}: key 'use_sliding_window': sliding-window attention is not supported", origin);
  FULCRUM_CHECK(!reader.boolean("attention_bias", false), "{}: key 'attention_bias': biases are not supported",
                origin);

  Qwen3MoeConfig config;
  config.vocab_size = reader.positive("vocab_size");
  config.hidden_size = reader.positive("hidden_size");
  config.intermediate_size = reader.positive("intermediate_size");
  config.num_hidden_layers = reader.positive("num_hidden_layers");
  // Every per-layer loop runs this many times: a corrupt count must fail here, not spin (the config fuzzer found
  // 2147483647). The family's deepest model has 94 layers.
  constexpr int kMaxLayers = 4096;
  FULCRUM_CHECK(config.num_hidden_layers <= kMaxLayers, "{}: key 'num_hidden_layers' ({}) exceeds {}", origin,
                config.num_hidden_layers, kMaxLayers);
  config.num_attention_heads = reader.positive("num_attention_heads");
  config.num_key_value_heads =
      reader.has("num_key_value_heads") ? reader.positive("num_key_value_heads") : config.num_attention_heads;
  FULCRUM_CHECK(config.num_attention_heads % config.num_key_value_heads == 0,
                "{}: key 'num_attention_heads' ({}) must be divisible by 'num_key_value_heads' ({})", origin,
                config.num_attention_heads, config.num_key_value_heads);
  if (reader.has("head_dim")) {
    config.head_dim = reader.positive("head_dim");
  } else {
    FULCRUM_CHECK(config.hidden_size % config.num_attention_heads == 0,
                  "{}: key 'hidden_size' ({}) must be divisible by 'num_attention_heads' ({}) when 'head_dim' is absent",
                  origin, config.hidden_size, config.num_attention_heads);
    config.head_dim = config.hidden_size / config.num_attention_heads;
  }
  FULCRUM_CHECK(config.head_dim % 2 == 0, "{}: key 'head_dim' must be even for rotary embeddings, got {}", origin,
                config.head_dim);

  config.num_experts = read_num_experts(reader);
  if (config.num_experts > 0) {
    config.moe_intermediate_size = reader.positive("moe_intermediate_size");
    config.num_experts_per_tok = reader.positive("num_experts_per_tok");
    FULCRUM_CHECK(config.num_experts_per_tok <= config.num_experts,
                  "{}: key 'num_experts_per_tok' ({}) exceeds the number of experts ({})", origin,
                  config.num_experts_per_tok, config.num_experts);
  }
  config.decoder_sparse_step = reader.has("decoder_sparse_step") ? reader.positive("decoder_sparse_step") : 1;
  if (reader.has("mlp_only_layers")) {
    const json& layers = root.at("mlp_only_layers");
    FULCRUM_CHECK(layers.is_array(), "{}: key 'mlp_only_layers' must be a list of layer indices", origin);
    for (const json& entry : layers) {
      FULCRUM_CHECK(entry.is_number_integer() && entry.get<int64_t>() >= 0 &&
                        entry.get<int64_t>() < config.num_hidden_layers,
                    "{}: key 'mlp_only_layers': {} is not a layer index in [0, {})", origin, eplb::json_excerpt(entry),
                    config.num_hidden_layers);
      config.mlp_only_layers.push_back(entry.get<int>());
    }
  }
  config.norm_topk_prob = reader.boolean("norm_topk_prob", false);
  config.tie_word_embeddings = reader.boolean("tie_word_embeddings", false);
  const double eps = reader.has("rms_norm_eps") ? reader.number(root.at("rms_norm_eps"), "rms_norm_eps") : 1e-6;
  FULCRUM_CHECK(eps > 0, "{}: key 'rms_norm_eps' must be positive, got {}", origin, eps);
  config.rms_norm_eps = static_cast<float>(eps);
  config.rope_theta = read_rope_theta(reader, root);
  config.max_position_embeddings =
      reader.has("max_position_embeddings") ? reader.positive("max_position_embeddings") : 0;
  config.quantization = parse_quantization_config(root, origin);
  return config;
}

Qwen3MoeConfig load_qwen3_moe_config(const std::string& path) {
  std::filesystem::path file(path);
  if (std::filesystem::is_directory(file)) file /= "config.json";
  std::ifstream in(file, std::ios::binary);
  FULCRUM_CHECK(in.good(), "{}: cannot open config file", file.string());
  std::stringstream text;
  text << in.rdbuf();
  return parse_qwen3_moe_config(eplb::parse_json_text(text.str(), file.string()), file.string());
}

std::string weight_cache_config_identity(const Qwen3MoeConfig& c) {
  return fmt::format("vocab {} hidden {} intermediate {} moe_intermediate {} layers {} heads {} kv_heads {} "
                     "head_dim {} experts {} top_k {} sparse_step {} mlp_only [{}] tie {}",
                     c.vocab_size, c.hidden_size, c.intermediate_size, c.moe_intermediate_size, c.num_hidden_layers,
                     c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.num_experts, c.num_experts_per_tok,
                     c.decoder_sparse_step, fmt::join(c.mlp_only_layers, " "), c.tie_word_embeddings) +
         // The dequantized weights of an FP8 checkpoint are cached; its identity says so.
         (c.quantization ? " fp8_block 128x128" : "");
}

}  // namespace fulcrum::model
