#pragma once
// The golden Hugging Face fixtures' expected outputs (golden.safetensors + golden.json), shared by the CPU
// golden test (model_golden_test.cpp) and the CUDA one (tests_cuda/).
#include <algorithm>
#include <iostream>
#include <map>
#include <cmath>
#include <fstream>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "eplb/json_text.hpp"
#include "model/generate.hpp"
#include "model/qwen3_moe.hpp"
#include "model/safetensors.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {

constexpr float kLogitTolerance = 1e-4f;  // max |logits - golden| and |router logits - golden|
constexpr double kNearTieMargin = 1e-3;   // below this golden top-1 margin, greedy tokens are not compared

struct GoldenSequence {
  std::vector<int32_t> input_ids;
  model::HostTensor logits;                      // [T, vocab_size]
  std::vector<model::HostTensor> router_logits;  // per MoE layer k: [T, num_experts]; empty when not dumped
  std::vector<int32_t> greedy_tokens;            // [8]
  double last_top1_margin = 0;
};

inline std::vector<GoldenSequence> read_golden(const std::string& dir, int num_moe_layers) {
  const model::SafetensorsFile file(dir + "/golden.safetensors");
  std::ifstream in(dir + "/golden.json");
  std::stringstream text;
  text << in.rdbuf();
  const auto meta = eplb::parse_json_text(text.str(), dir + "/golden.json");
  std::vector<GoldenSequence> sequences;
  for (size_t i = 0; i < meta["sequences"].size(); ++i) {
    const std::string prefix = "seq" + std::to_string(i) + ".";
    GoldenSequence seq;
    for (const int64_t id : file.read_i64(prefix + "input_ids")) seq.input_ids.push_back(static_cast<int32_t>(id));
    for (const int64_t id : file.read_i64(prefix + "greedy_tokens")) seq.greedy_tokens.push_back(static_cast<int32_t>(id));
    seq.logits = file.read_f32(prefix + "logits");
    // The fp8 fixture's golden has no router logits: then none are compared.
    for (int k = 0; k < num_moe_layers && file.contains(prefix + "router_logits." + std::to_string(k)); ++k) {
      seq.router_logits.push_back(file.read_f32(prefix + "router_logits." + std::to_string(k)));
    }
    seq.last_top1_margin = meta["sequences"][i]["last_top1_margin"].get<double>();
    sequences.push_back(std::move(seq));
  }
  return sequences;
}

inline float max_abs_diff(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  float diff = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) diff = std::max(diff, std::abs(a[i] - b[i]));
  return diff;
}

// The whole model on `backend` against a golden fixture: prompt logits and prefill router logits within
// kLogitTolerance, and the 8 greedy tokens (with KV cache) where the golden margin is not a near-tie.
inline void expect_model_matches_golden(model::Backend& backend, const std::string& name) {
  const std::string dir = golden_model_dir(name);
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(dir);
  model::Qwen3MoeModel qwen(config, backend);
  model::Checkpoint checkpoint(dir);
  qwen.load_weights(checkpoint);
  const int num_moe_layers = static_cast<int>(config.moe_layer_indices().size());
  const std::vector<GoldenSequence> golden = read_golden(dir, num_moe_layers);

  // All sequences in one batch; the first router call per layer is the prefill of every prompt.
  std::map<int, std::vector<float>> prefill_router;  // layer_idx -> [total prompt tokens, num_experts]
  model::ForwardHooks hooks;
  hooks.on_router = [&](int layer_idx, const model::Tensor& logits, const model::RouterChoice&) {
    if (!prefill_router.count(layer_idx)) prefill_router[layer_idx] = backend.download(logits);
  };
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& seq : golden) prompts.push_back(seq.input_ids);
  const model::GenerateResult result = model::generate_greedy(qwen, backend, prompts, 8, hooks);

  float worst_logits = 0, worst_router = 0;
  size_t token_offset = 0;
  for (size_t i = 0; i < golden.size(); ++i) {
    const GoldenSequence& seq = golden[i];
    const size_t num_tokens = seq.input_ids.size();
    EXPECT_EQ(result.prompt_logits[i].shape, seq.logits.shape);
    const float logits_diff = max_abs_diff(result.prompt_logits[i].data, seq.logits.data);
    EXPECT_LE(logits_diff, kLogitTolerance) << "sequence " << i;
    worst_logits = std::max(worst_logits, logits_diff);
    const auto moe_layers = config.moe_layer_indices();
    for (int k = 0; k < static_cast<int>(seq.router_logits.size()); ++k) {
      const std::vector<float>& all = prefill_router.at(moe_layers[k]);
      const std::span<const float> mine(all.data() + token_offset * config.num_experts, num_tokens * config.num_experts);
      const float router_diff = max_abs_diff(mine, seq.router_logits[k].data);
      EXPECT_LE(router_diff, kLogitTolerance) << "sequence " << i << " MoE layer " << k;
      worst_router = std::max(worst_router, router_diff);
    }
    token_offset += num_tokens;
    if (seq.last_top1_margin >= kNearTieMargin) {
      EXPECT_EQ(result.new_tokens[i], seq.greedy_tokens) << "sequence " << i;
    } else {
      std::cout << "[ note ] " << name << " sequence " << i << ": near-tie margin " << seq.last_top1_margin
                << ", greedy tokens not compared\n";
    }
  }
  std::cout << "[ golden ] " << backend.name() << " " << name << ": max |logits - golden| = " << worst_logits
            << ", max |router logits - golden| = " << worst_router << "\n";
  ::testing::Test::RecordProperty("max_abs_logit_diff", std::to_string(worst_logits));
}

}  // namespace fulcrum::test
