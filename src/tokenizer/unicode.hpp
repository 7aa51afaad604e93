#pragma once
// UTF-8 helpers the tokenizer needs: validation, HF-style lossy repair, and Unicode normalization forms.
#include <cstddef>
#include <string>
#include <string_view>

namespace fulcrum::tokenizer {

// Appends the UTF-8 encoding of `cp` (a scalar value) to `out`.
void append_utf8(std::string& out, char32_t cp);

// Decodes the code point at s[i] (s must be valid UTF-8 there) and moves i past it.
char32_t next_code_point(std::string_view s, size_t& i);

bool is_valid_utf8(std::string_view s);

// Replaces each maximal ill-formed subsequence by U+FFFD (Unicode's recommended practice, which is what
// Rust's String::from_utf8_lossy and so HF's decode do).
std::string utf8_lossy(std::string_view bytes);

enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };

// Normalizes valid UTF-8 text (utf8proc does the Unicode tables). Throws fulcrum::Error on invalid input.
std::string normalize(std::string_view text, NormalForm form);

// Unicode White_Space (\s in HF's regex engines) and word characters (\w, what single_word added tokens test).
bool is_unicode_space(char32_t cp);
bool is_word_char(char32_t cp);

}  // namespace fulcrum::tokenizer
