#pragma once
// Shared by the tokenizer tests: the golden tokenizers and small hand-made tokenizer.json specs.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_data.hpp"
#include "tokenizer/byte_level.hpp"
#include "tokenizer/unicode.hpp"

namespace fulcrum::test {

// Every folder under golden/tokenizer (sorted): each holds tokenizer.json and golden.json.
inline std::vector<std::string> golden_tokenizer_dirs() {
  std::vector<std::string> dirs;
  for (const auto& entry : std::filesystem::directory_iterator(shared_path("golden/tokenizer"))) {
    if (entry.is_directory()) dirs.push_back(entry.path().string());
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

inline std::string golden_qwen_dir() { return shared_path("golden/tokenizer/bpe-qwen-style-2k"); }

// A byte-level BPE spec whose vocab is the 256 byte characters plus the given merges' results.
inline nlohmann::json tiny_byte_level_spec(const std::vector<std::pair<std::string, std::string>>& merges) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[tokenizer::bytes_to_byte_level(std::string(1, static_cast<char>(b)))] = b;
  nlohmann::json merge_list = nlohmann::json::array();
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = static_cast<int>(vocab.size());
    merge_list.push_back(a + " " + b);
  }
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", nlohmann::json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}}}};
}

}  // namespace fulcrum::test
