#include "tokenizer/byte_level.hpp"

#include <array>

#include "tokenizer/unicode.hpp"

namespace fulcrum::tokenizer {
namespace {

struct Alphabet {
  std::array<char32_t, 256> char_of{};
  std::array<std::string, 256> utf8_of{};
  std::array<int, 0x144> byte_of{};  // inverse; -1 off the alphabet (whose largest code point is U+0143)
};

// Printable Latin-1 bytes stand for themselves; the others (controls, space, DEL, NBSP, soft hyphen)
// take U+0100, U+0101, ... in byte order.
const Alphabet& alphabet() {
  static const Alphabet table = [] {
    Alphabet a;
    a.byte_of.fill(-1);
    char32_t next = 0x100;
    for (unsigned b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      a.char_of[b] = printable ? b : next++;
      append_utf8(a.utf8_of[b], a.char_of[b]);
      a.byte_of[a.char_of[b]] = static_cast<int>(b);
    }
    return a;
  }();
  return table;
}

}  // namespace

std::string bytes_to_byte_level(std::string_view bytes) {
  const Alphabet& a = alphabet();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const char c : bytes) out += a.utf8_of[static_cast<unsigned char>(c)];
  return out;
}

std::optional<unsigned char> byte_of_char(char32_t cp) {
  const Alphabet& a = alphabet();
  if (cp >= a.byte_of.size() || a.byte_of[cp] < 0) return std::nullopt;
  return static_cast<unsigned char>(a.byte_of[cp]);
}

std::string byte_level_token_bytes(std::string_view token) {
  std::string out;
  out.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    const std::optional<unsigned char> b = byte_of_char(next_code_point(token, i));
    if (!b) return std::string(token);
    out += static_cast<char>(*b);
  }
  return out;
}

}  // namespace fulcrum::tokenizer
