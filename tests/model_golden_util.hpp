#pragma once
// The golden Hugging Face fixtures' expected outputs (golden.safetensors + golden.json), shared by the CPU
// golden test (model_golden_test.cpp) and the CUDA one (tests_cuda/).
#include <algorithm>
#include <cmath>
#include <fstream>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "eplb/json_text.hpp"
#include "model/safetensors.hpp"

namespace fulcrum::test {

constexpr float kLogitTolerance = 1e-4f;  // max |logits - golden| and |router logits - golden|
constexpr double kNearTieMargin = 1e-3;   // below this golden top-1 margin, greedy tokens are not compared

struct GoldenSequence {
  std::vector<int32_t> input_ids;
  model::HostTensor logits;                      // [T, vocab_size]
  std::vector<model::HostTensor> router_logits;  // per MoE layer k: [T, num_experts]
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
    for (int k = 0; k < num_moe_layers; ++k) seq.router_logits.push_back(file.read_f32(prefix + "router_logits." + std::to_string(k)));
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

}  // namespace fulcrum::test
