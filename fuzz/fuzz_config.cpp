// config.json (every command that loads a model): the JSON text, the Qwen3-MoE fields and quantization_config,
// then what the loaders derive from a config that parses (MoE layer list, the weight cache's identity line).
#include <cstddef>
#include <cstdint>
#include <string>

#include "eplb/json_text.hpp"
#include "fuzz_util.hpp"
#include "model/qwen3_config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fulcrum;
  const std::string text(reinterpret_cast<const char*>(data), size);
  nlohmann::json doc;
  if (!fuzz::parses([&] { doc = eplb::parse_json_text(text, "config.json"); })) return 0;
  model::Qwen3MoeConfig config;
  if (!fuzz::parses([&] { config = model::parse_qwen3_moe_config(doc, "config.json"); })) return 0;
  fuzz::parses([&] {
    const auto moe_layers = config.moe_layer_indices();
    for (size_t k = 0; k < moe_layers.size(); ++k) {
      if (config.moe_layer_ordinal(moe_layers[k]) != static_cast<int>(k)) {
        fuzz::fail("moe_layer_ordinal disagrees with moe_layer_indices", text);
      }
    }
    model::weight_cache_config_identity(config);
  });
  return 0;
}
