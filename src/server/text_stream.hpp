#pragma once
// Incremental text of a token stream for SSE deltas. A delta never ends inside a UTF-8 character that
// later tokens complete (decode marks such a tail U+FFFD), never holds a stop string, and never ends with a
// prefix of one, since that text may be cut when the stop string completes. Without a tokenizer every delta is empty.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.hpp"

namespace fulcrum::server {

class TextStream {
 public:
  TextStream(const tokenizer::Tokenizer* tokenizer, std::vector<std::string> stop)
      : tokenizer_(tokenizer), stop_(std::move(stop)) {}

  // Appends tokens; returns the new text that is safe to emit now.
  std::string push(std::span<const int32_t> tokens);
  // The request finished: returns the rest of the text, cut at `stop_text_length` when a stop string ended it.
  std::string finish(std::optional<size_t> stop_text_length);
  // The text emitted so far.
  const std::string& emitted() const { return emitted_; }

 private:
  std::string take(size_t end);

  const tokenizer::Tokenizer* tokenizer_;
  std::vector<std::string> stop_;
  std::vector<int32_t> tokens_;
  std::string full_;
  std::string emitted_;
};

}  // namespace fulcrum::server
