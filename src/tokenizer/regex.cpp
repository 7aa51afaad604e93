#include "tokenizer/regex.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "eplb/error.hpp"
#include "eplb/json_text.hpp"
#include "tokenizer/unicode.hpp"

namespace fulcrum::tokenizer {
namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

}  // namespace

struct Regex::Impl {
  pcre2_code* code = nullptr;
  ~Impl() { pcre2_code_free(code); }
};

std::string with_white_space_property(const std::string& pattern) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '\\' || i + 1 == pattern.size()) {
      out += pattern[i];
      continue;
    }
    const char next = pattern[++i];  // an escape pair is copied whole, so "\\s" stays a backslash and an s
    if (next == 's') {
      out += "\\p{White_Space}";
    } else if (next == 'S') {
      out += "\\P{White_Space}";
    } else {
      out += '\\';
      out += next;
    }
  }
  return out;
}

Regex::Regex(const std::string& pattern, bool literal) : impl_(std::make_unique<Impl>()) {
  const std::string source = literal ? pattern : with_white_space_property(pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);  // LITERAL refuses UCP
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(), options, &error, &offset,
                              nullptr);
  FULCRUM_CHECK(impl_->code != nullptr, "bad regex '{}': {} at offset {}", eplb::printable_excerpt(pattern, 200), pcre2_message(error), offset);
  pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE);  // best effort: the interpreter is used where JIT is absent
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view text) const {
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
      pcre2_match_data_create_from_pattern(impl_->code, nullptr), &pcre2_match_data_free);
  FULCRUM_CHECK(data != nullptr, "out of memory for regex match data");
  std::vector<std::pair<size_t, size_t>> matches;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  uint32_t check = 0;  // PCRE2 validates the UTF-8 on the first call only
  for (size_t start = 0; start <= text.size();) {
    const int rc = pcre2_match(impl_->code, subject, text.size(), start, check, data.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    FULCRUM_CHECK(rc >= 0, "regex match failed: {}", pcre2_message(rc));
    check = PCRE2_NO_UTF_CHECK;
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    if (ovector[1] > ovector[0]) {
      matches.emplace_back(ovector[0], ovector[1]);
      start = ovector[1];
    } else {  // an empty match: step over one code point so the scan moves on
      if (ovector[0] >= text.size()) break;
      size_t next = ovector[0];
      next_code_point(text, next);
      start = next;
    }
  }
  return matches;
}

}  // namespace fulcrum::tokenizer
