#include "server/text_stream.hpp"

#include <algorithm>

namespace fulcrum::server {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace

std::string TextStream::take(size_t end) {
  end = std::min(end, full_.size());
  if (end <= emitted_.size()) return {};
  std::string delta = full_.substr(emitted_.size(), end - emitted_.size());
  emitted_ += delta;
  return delta;
}

std::string TextStream::push(std::span<const int32_t> tokens) {
  if (!tokenizer_) return {};
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  full_ = tokenizer_->decode(tokens_);
  size_t end = full_.size();
  while (end >= kReplacement.size() && std::string_view(full_).substr(0, end).ends_with(kReplacement)) {
    end -= kReplacement.size();
  }
  // Never emit a stop string (the scheduler cuts the text before it) ...
  for (const std::string& s : stop_) end = std::min(end, full_.find(s));
  // ... nor the longest tail that could still grow into one.
  size_t hold = 0;
  for (const std::string& s : stop_) {
    for (size_t n = std::min(s.size() - 1, end); n > hold; --n) {
      if (std::string_view(full_).substr(end - n, n) == std::string_view(s).substr(0, n)) {
        hold = n;
        break;
      }
    }
  }
  return take(end - hold);
}

std::string TextStream::finish(std::optional<size_t> stop_text_length) {
  if (!tokenizer_) return {};
  return take(stop_text_length.value_or(full_.size()));
}

}  // namespace fulcrum::server
