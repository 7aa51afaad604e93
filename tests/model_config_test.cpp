// Qwen3-MoE config.json parsing: both conventions, layer kinds, one-line errors naming key and file.
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "eplb/json_text.hpp"
#include "model/qwen3_config.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

using model::Qwen3MoeConfig;
using nlohmann::json;

json read_json(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return eplb::parse_json_text(text.str(), path);
}

void write_json(const std::string& path, const json& value) { std::ofstream(path) << value.dump(2); }

void expect_same(const Qwen3MoeConfig& a, const Qwen3MoeConfig& b) {
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  EXPECT_EQ(a.decoder_sparse_step, b.decoder_sparse_step);
  EXPECT_EQ(a.mlp_only_layers, b.mlp_only_layers);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
}

// The golden config rewritten in the hub convention (num_experts, rope_theta).
json to_hub_convention(json config) {
  config["num_experts"] = config["num_local_experts"];
  config.erase("num_local_experts");
  config["rope_theta"] = config["rope_parameters"]["rope_theta"];
  config.erase("rope_parameters");
  return config;
}

TEST(ModelConfig, GoldenConfigsLoad) {
  const Qwen3MoeConfig mix = model::load_qwen3_moe_config(golden_model_dir("qwen3moe-tiny-dense-mix"));
  EXPECT_EQ(mix.num_hidden_layers, 4);
  EXPECT_EQ(mix.num_experts, 16);
  EXPECT_EQ(mix.num_experts_per_tok, 4);
  EXPECT_EQ(mix.num_key_value_heads, 2);
  EXPECT_EQ(mix.head_dim, 16);
  EXPECT_EQ(mix.rope_theta, 1e6);
  EXPECT_EQ(mix.moe_layer_indices(), (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(mix.moe_layer_ordinal(3), 2);
  EXPECT_EQ(mix.moe_layer_ordinal(2), -1);
}

TEST(ModelConfig, BothConventionsLoadIdentically) {
  for (const char* name : {"qwen3moe-tiny-128e", "qwen3moe-tiny-dense-mix"}) {
    const std::string original = golden_model_dir(name) + "/config.json";
    TempDir dir("config");
    const json hub = to_hub_convention(read_json(original));
    ASSERT_FALSE(hub.contains("num_local_experts"));
    write_json(dir.file("config.json"), hub);
    expect_same(model::load_qwen3_moe_config(original), model::load_qwen3_moe_config(dir.path()));
  }
}

TEST(ModelConfig, RealHubConfigs) {
  const Qwen3MoeConfig a3b = model::load_qwen3_moe_config(shared_path("data/configs/qwen3-30b-a3b.config.json"));
  EXPECT_EQ(a3b.num_hidden_layers, 48);
  EXPECT_EQ(a3b.num_experts, 128);
  EXPECT_EQ(a3b.num_experts_per_tok, 8);
  EXPECT_EQ(a3b.head_dim, 128);
  EXPECT_EQ(a3b.num_key_value_heads, 4);
  EXPECT_EQ(a3b.moe_layer_indices().size(), 48u);
  const Qwen3MoeConfig a22b = model::load_qwen3_moe_config(shared_path("data/configs/qwen3-235b-a22b.config.json"));
  EXPECT_EQ(a22b.num_hidden_layers, 94);
  EXPECT_EQ(a22b.num_experts, 128);
}

TEST(ModelConfig, LayerKinds) {
  json config = read_json(golden_model_dir("qwen3moe-tiny-dense-mix") + "/config.json");
  config["decoder_sparse_step"] = 2;
  config["mlp_only_layers"] = json::array({3});
  const Qwen3MoeConfig c = model::parse_qwen3_moe_config(config, "inline");
  EXPECT_EQ(c.moe_layer_indices(), (std::vector<int>{1}));  // layer 3 is (3+1)%2==0 but mlp-only
  config["num_local_experts"] = 0;
  EXPECT_TRUE(model::parse_qwen3_moe_config(config, "inline").moe_layer_indices().empty());
  config.erase("head_dim");
  EXPECT_EQ(model::parse_qwen3_moe_config(config, "inline").head_dim, 64 / 4);
}

// Writes the golden config with `edit` applied and returns the load error ("" when it loads).
std::string error_after(const std::function<void(json&)>& edit) {
  TempDir dir("config_err");
  json config = read_json(golden_model_dir("qwen3moe-tiny-dense-mix") + "/config.json");
  edit(config);
  write_json(dir.file("config.json"), config);
  return error_of([&] { model::load_qwen3_moe_config(dir.path()); });
}

TEST(ModelConfig, InvalidValuesNameKeyAndFile) {
  const std::vector<std::pair<std::function<void(json&)>, std::string>> cases = {
      {[](json& c) { c.erase("hidden_size"); }, "'hidden_size'"},
      {[](json& c) { c["vocab_size"] = 0; }, "'vocab_size'"},
      {[](json& c) { c["intermediate_size"] = -3; }, "'intermediate_size'"},
      {[](json& c) { c["num_experts_per_tok"] = 17; }, "'num_experts_per_tok'"},
      {[](json& c) { c["num_key_value_heads"] = 3; }, "'num_key_value_heads'"},
      {[](json& c) { c["rope_parameters"]["rope_type"] = "yarn"; }, "rope_type"},
      {[](json& c) { c["hidden_act"] = "gelu"; }, "'hidden_act'"},
      {[](json& c) { c["use_sliding_window"] = true; }, "'use_sliding_window'"},
      {[](json& c) { c["model_type"] = "llama"; }, "'model_type'"},
      {[](json& c) { c.erase("num_local_experts"); }, "'num_experts'"},
      {[](json& c) { c["num_experts"] = 8; }, "disagree"},
      {[](json& c) { c.erase("rope_parameters"); }, "'rope_theta'"},
      {[](json& c) { c["mlp_only_layers"] = json::array({9}); }, "'mlp_only_layers'"},
      {[](json& c) { c["hidden_size"] = "64"; }, "'hidden_size'"},
      {[](json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; }, "'rope_scaling'"},
      {[](json& c) { c["attention_bias"] = true; }, "'attention_bias'"},
      {[](json& c) { c["num_hidden_layers"] = 2147483647; }, "'num_hidden_layers'"},
  };
  for (const auto& [edit, key] : cases) {
    const std::string message = error_after(edit);
    EXPECT_NE(message.find(key), std::string::npos) << message;
    EXPECT_NE(message.find("config.json"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  EXPECT_EQ(error_after([](json&) {}), "");
}

}  // namespace
}  // namespace fulcrum::test
