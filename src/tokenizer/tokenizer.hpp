#pragma once
// A Hugging Face tokenizer.json with a byte-level BPE model, as Qwen3 ships it:
//   added tokens -> normalizer -> pre_tokenizer -> BPE -> ids, and ids -> ByteLevel decoder -> text.
// Features the file uses but this does not implement are refused at load with a one-line fulcrum::Error.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/added_tokens.hpp"
#include "tokenizer/bpe.hpp"
#include "tokenizer/normalizer.hpp"
#include "tokenizer/pre_tokenizer.hpp"

namespace fulcrum::tokenizer {

class Tokenizer {
 public:
  // `path`: a tokenizer.json file, or a folder holding one.
  static Tokenizer from_file(const std::string& path);
  // `source` only names the origin in errors.
  static Tokenizer from_json(const nlohmann::json& spec, const std::string& source);

  // Token ids of UTF-8 `text` (no special tokens are added around it). Throws on invalid UTF-8.
  std::vector<int32_t> encode(std::string_view text) const;
  // Text of `ids`; byte sequences that are not valid UTF-8 become U+FFFD. Throws on an unknown id.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  int32_t id_bound() const { return id_bound_; }  // every id is below this
  const AddedVocabulary& added_tokens() const { return added_; }

 private:
  void encode_plain(std::string_view text, std::vector<int32_t>& ids) const;

  BpeModel model_;
  AddedVocabulary added_;
  Normalizer normalizer_;
  PreTokenizer pre_tokenizer_;
  int32_t id_bound_ = 0;
};

}  // namespace fulcrum::tokenizer
