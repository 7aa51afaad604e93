#pragma once
// A compiled PCRE2 pattern (UTF + UCP) used by the Split and ByteLevel pre-tokenizers.
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fulcrum::tokenizer {

class Regex {
 public:
  // `literal`: match `pattern` as plain text (Split's {"String": ...} form). Throws fulcrum::Error.
  explicit Regex(const std::string& pattern, bool literal = false);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // [begin, end) byte ranges of the successive non-empty, non-overlapping matches in valid UTF-8 `text`.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// HF's engine (Oniguruma) reads \s and \S as Unicode White_Space; PCRE2's UCP \s also takes U+180E.
// This rewrites them to the White_Space property so both engines agree.
std::string with_white_space_property(const std::string& pattern);

}  // namespace fulcrum::tokenizer
