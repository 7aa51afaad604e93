// tokenizer.json (serve, tokenize, make-model --tokenizer): arbitrary bytes parsed and built into a tokenizer,
// then, when that succeeds, a fixed mixed-script text encoded and its ids decoded.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "eplb/json_text.hpp"
#include "fuzz_util.hpp"
#include "tokenizer/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fulcrum;
  const std::string text(reinterpret_cast<const char*>(data), size);
  nlohmann::json spec;
  if (!fuzz::parses([&] { spec = eplb::parse_json_text(text, "tokenizer.json"); })) return 0;
  std::optional<tokenizer::Tokenizer> tok;
  if (!fuzz::parses([&] { tok.emplace(tokenizer::Tokenizer::from_json(spec, "tokenizer.json")); })) return 0;
  std::vector<int32_t> ids;
  if (!fuzz::parses([&] { ids = tok->encode("Hello, world! 123 <|im_start|>user\n\u4f60\u597d caf\u00e9\t  x"); })) {
    return 0;
  }
  for (const int32_t id : ids) {
    if (id < 0 || id >= tok->id_bound()) fuzz::fail("encode gave an id out of range", text);
  }
  fuzz::parses([&] { tok->decode(ids); });
  return 0;
}
