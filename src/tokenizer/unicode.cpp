#include "tokenizer/unicode.hpp"

#include <cstdint>
#include <cstdlib>
#include <memory>

#include <utf8proc.h>

#include "eplb/error.hpp"

namespace fulcrum::tokenizer {
namespace {

// Length of the longest well-formed prefix (per Unicode Table 3-7) of the sequence starting at s[i];
// `complete` says whether it is a whole code point. Always at least 1.
size_t well_formed_prefix(std::string_view s, size_t i, bool& complete) {
  const auto lead = static_cast<uint8_t>(s[i]);
  complete = false;
  if (lead < 0x80) {
    complete = true;
    return 1;
  }
  size_t continuation = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    continuation = 1;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    continuation = 2;
    if (lead == 0xE0) lo = 0xA0;  // no overlong forms
    if (lead == 0xED) hi = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    continuation = 3;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return 1;  // C0, C1, F5..FF and stray continuation bytes never start a sequence
  }
  size_t n = 1;
  while (n <= continuation && i + n < s.size()) {
    const auto b = static_cast<uint8_t>(s[i + n]);
    if (b < lo || b > hi) break;
    lo = 0x80;
    hi = 0xBF;
    ++n;
  }
  complete = n == continuation + 1;
  return n;
}

}  // namespace

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

char32_t next_code_point(std::string_view s, size_t& i) {
  const auto lead = static_cast<uint8_t>(s[i]);
  size_t extra = lead < 0x80 ? 0 : lead < 0xE0 ? 1 : lead < 0xF0 ? 2 : 3;
  char32_t cp = extra == 0 ? lead : lead & (0x3F >> extra);
  for (size_t k = 1; k <= extra; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  i += extra + 1;
  return cp;
}

bool is_valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    bool complete = false;
    i += well_formed_prefix(s, i, complete);
    if (!complete) return false;
  }
  return true;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    bool complete = false;
    const size_t n = well_formed_prefix(bytes, i, complete);
    if (complete) {
      out.append(bytes.substr(i, n));
    } else {
      append_utf8(out, 0xFFFD);
    }
    i += n;
  }
  return out;
}

std::string normalize(std::string_view text, NormalForm form) {
  bool ascii = true;
  for (const char c : text) ascii = ascii && static_cast<uint8_t>(c) < 0x80;
  if (ascii) return std::string(text);  // ASCII is invariant under every form; skip the tables
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNFC: options |= UTF8PROC_COMPOSE; break;
    case NormalForm::kNFD: options |= UTF8PROC_DECOMPOSE; break;
    case NormalForm::kNFKC: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case NormalForm::kNFKD: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* raw = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &raw,
                                          static_cast<utf8proc_option_t>(options));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(raw, &std::free);
  FULCRUM_CHECK(n >= 0, "unicode normalization failed: {}", utf8proc_errmsg(n));
  return std::string(reinterpret_cast<const char*>(raw), static_cast<size_t>(n));
}

bool is_unicode_space(char32_t cp) {
  if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85) return true;
  const utf8proc_category_t cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL || cat == UTF8PROC_CATEGORY_ZP;
}

bool is_word_char(char32_t cp) {
  // Unicode \w: Alphabetic, marks, decimal digits, connector punctuation, joiners. Alphabetic is letters,
  // letter numbers and Other_Alphabetic, whose members outside the marks are the enclosed Latin letters.
  if (cp == 0x200C || cp == 0x200D || (cp >= 0x24B6 && cp <= 0x24E9) || (cp >= 0x1F130 && cp <= 0x1F189)) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

}  // namespace fulcrum::tokenizer
