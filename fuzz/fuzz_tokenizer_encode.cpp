// Tokenizer encode (every text prompt): arbitrary bytes through the Qwen-style golden tokenizer (added tokens,
// NFC, the Qwen split regex, byte-level BPE). Invalid UTF-8 must be a one-line error; valid text must give ids
// below id_bound() that decode without error, and ASCII text (which NFC leaves alone) must decode to itself.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.hpp"
#include "tokenizer/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fulcrum;
  static const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_file(FULCRUM_FUZZ_TOKENIZER);
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<int32_t> ids;
  if (!fuzz::parses([&] { ids = tok.encode(text); })) return 0;
  for (const int32_t id : ids) {
    if (id < 0 || id >= tok.id_bound()) fuzz::fail("encode gave an id out of range", text);
  }
  std::string decoded;
  if (!fuzz::parses([&] { decoded = tok.decode(ids); })) fuzz::fail("the ids encode gave do not decode", text);
  bool ascii = true;
  for (const char c : text) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  if (ascii && decoded != text) fuzz::fail("ASCII text does not decode to itself", text);
  return 0;
}
