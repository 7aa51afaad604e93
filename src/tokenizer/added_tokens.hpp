#pragma once
// Added tokens (special tokens such as <|im_start|>): found in the text before pre-tokenization so BPE
// never splits them. Non-normalized ones are matched in the raw text, normalized ones after normalization.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace fulcrum::tokenizer {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;  // only where no word character touches it on either side
  bool lstrip = false;       // the match swallows the whitespace before it
  bool rstrip = false;       // and after it
  bool normalized = false;   // matched in normalized text rather than raw text
  bool special = false;      // dropped by decode(skip_special_tokens)
};

// A run of the input: plain text (id < 0) or one added token.
struct TextSegment {
  std::string_view text;
  int32_t id = -1;
};

class AddedVocabulary {
 public:
  // `pattern`: the text to look for: the content itself, or for a normalized token the content after
  // the tokenizer's normalizer (so a token written decomposed still matches NFC text).
  void add(AddedToken token, std::string pattern);
  const AddedToken* find_id(int32_t id) const;
  const AddedToken* find_content(std::string_view content) const;
  const std::vector<AddedToken>& tokens() const { return tokens_; }

  // Cuts `text` at the added tokens whose `normalized` flag equals `normalized`: leftmost match first,
  // the longest one where several start at the same place.
  std::vector<TextSegment> split(std::string_view text, bool normalized) const;

 private:
  std::vector<AddedToken> tokens_;
  std::vector<std::string> patterns_;  // parallel to tokens_
  std::unordered_map<int32_t, size_t> by_id_;
  std::array<std::vector<size_t>, 256> by_first_byte_;  // token indices, longest content first
};

}  // namespace fulcrum::tokenizer
