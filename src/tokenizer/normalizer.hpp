#pragma once
// The "normalizer" of tokenizer.json: null, a Unicode normal form, or a Sequence of those.
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/unicode.hpp"

namespace fulcrum::tokenizer {

class Normalizer {
 public:
  Normalizer() = default;  // the identity, for "normalizer": null
  // `file` only names the source in errors about unsupported normalizers.
  static Normalizer from_json(const nlohmann::json& spec, const std::string& file);

  std::string apply(std::string_view text) const;

 private:
  std::vector<NormalForm> forms_;
};

}  // namespace fulcrum::tokenizer
