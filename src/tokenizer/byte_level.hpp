#pragma once
// GPT-2's byte-level alphabet: each of the 256 bytes is shown as one printable code point, so BPE works on
// text with no spaces or control characters while staying lossless over arbitrary bytes.
#include <optional>
#include <string>
#include <string_view>

namespace fulcrum::tokenizer {

// The byte-level spelling of `bytes`: one mapped code point (UTF-8 encoded) per input byte.
std::string bytes_to_byte_level(std::string_view bytes);

// The byte a mapped code point stands for, or nullopt when `cp` is not in the alphabet.
std::optional<unsigned char> byte_of_char(char32_t cp);

// What the ByteLevel decoder makes of one token: its bytes when every character is in the alphabet,
// otherwise the token's own UTF-8 (added tokens such as "<|im_end|>" or ones holding a plain space).
std::string byte_level_token_bytes(std::string_view token);

}  // namespace fulcrum::tokenizer
