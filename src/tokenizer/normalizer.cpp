#include "tokenizer/normalizer.hpp"

#include "eplb/error.hpp"
#include "eplb/json_text.hpp"

namespace fulcrum::tokenizer {
namespace {

void add_steps(const nlohmann::json& spec, const std::string& file, std::vector<NormalForm>& forms) {
  if (spec.is_null()) return;
  FULCRUM_CHECK(spec.is_object() && spec.contains("type"), "{}: normalizer without a type", file);
  const std::string type = spec["type"].get<std::string>();
  if (type == "Sequence") {
    for (const auto& step : spec.at("normalizers")) add_steps(step, file, forms);
  } else if (type == "NFC") {
    forms.push_back(NormalForm::kNFC);
  } else if (type == "NFD") {
    forms.push_back(NormalForm::kNFD);
  } else if (type == "NFKC") {
    forms.push_back(NormalForm::kNFKC);
  } else if (type == "NFKD") {
    forms.push_back(NormalForm::kNFKD);
  } else {
    FULCRUM_CHECK(false, "{}: unsupported normalizer '{}' (supported: NFC, NFD, NFKC, NFKD, Sequence)", file,
                  eplb::printable_excerpt(type));
  }
}

}  // namespace

Normalizer Normalizer::from_json(const nlohmann::json& spec, const std::string& file) {
  Normalizer n;
  add_steps(spec, file, n.forms_);
  return n;
}

std::string Normalizer::apply(std::string_view text) const {
  std::string out(text);
  for (const NormalForm form : forms_) out = normalize(out, form);
  return out;
}

}  // namespace fulcrum::tokenizer
