#include "tokenizer/tokenizer.hpp"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "eplb/error.hpp"
#include "eplb/json_text.hpp"
#include "tokenizer/byte_level.hpp"
#include "tokenizer/unicode.hpp"

namespace fulcrum::tokenizer {
namespace {

bool is_null(const nlohmann::json& spec, const char* key) { return !spec.contains(key) || spec[key].is_null(); }

std::string type_of(const nlohmann::json& spec, const char* key) {
  return is_null(spec, key) ? "null" : spec[key].value("type", std::string("?"));
}

}  // namespace

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::string file = path;
  if (std::filesystem::is_directory(path)) file = (std::filesystem::path(path) / "tokenizer.json").string();
  std::ifstream in(file, std::ios::binary);
  FULCRUM_CHECK(in.good(), "cannot open tokenizer file '{}'", file);
  std::ostringstream text;
  text << in.rdbuf();
  return from_json(eplb::parse_json_text(text.str(), file), file);
}

Tokenizer Tokenizer::from_json(const nlohmann::json& spec, const std::string& source) {
  Tokenizer t;
  try {
    FULCRUM_CHECK(spec.is_object() && spec.contains("model"), "{}: no 'model' section", source);
    FULCRUM_CHECK(is_null(spec, "truncation"), "{}: truncation is not supported", source);
    FULCRUM_CHECK(is_null(spec, "padding"), "{}: padding is not supported", source);
    // ByteLevel's post-processor only moves offsets, which encode() does not report.
    const std::string post = type_of(spec, "post_processor");
    FULCRUM_CHECK(post == "null" || post == "ByteLevel", "{}: unsupported post_processor '{}'", source,
                  eplb::printable_excerpt(post));
    const std::string decoder = type_of(spec, "decoder");
    FULCRUM_CHECK(decoder == "ByteLevel", "{}: unsupported decoder '{}' (supported: ByteLevel)", source,
                  eplb::printable_excerpt(decoder));

    t.model_ = BpeModel::from_json(spec["model"], source);
    t.normalizer_ = Normalizer::from_json(spec.value("normalizer", nlohmann::json()), source);
    t.pre_tokenizer_ = PreTokenizer::from_json(spec.value("pre_tokenizer", nlohmann::json()), source);
    t.id_bound_ = t.model_.id_bound();
    for (const auto& entry : spec.value("added_tokens", nlohmann::json::array())) {
      AddedToken a;
      const nlohmann::json& id = entry.at("id");
      FULCRUM_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < kMaxTokenIds,
                    "{}: added token id {} is not an integer in [0, {})", source, eplb::json_excerpt(id), kMaxTokenIds);
      a.id = id.get<int32_t>();
      a.content = entry.at("content").get<std::string>();
      a.single_word = entry.value("single_word", false);
      a.lstrip = entry.value("lstrip", false);
      a.rstrip = entry.value("rstrip", false);
      a.normalized = entry.value("normalized", false);
      a.special = entry.value("special", false);
      FULCRUM_CHECK(is_valid_utf8(a.content), "{}: added token {} is not valid UTF-8", source, a.id);
      t.id_bound_ = std::max(t.id_bound_, a.id + 1);
      std::string pattern = a.normalized ? t.normalizer_.apply(a.content) : a.content;
      t.added_.add(std::move(a), std::move(pattern));
    }
  } catch (const nlohmann::json::exception& e) {
    FULCRUM_CHECK(false, "{}: malformed tokenizer ({})", source, e.what());
  }
  return t;
}

void Tokenizer::encode_plain(std::string_view text, std::vector<int32_t>& ids) const {
  for (const std::string& piece : pre_tokenizer_.split(text)) model_.encode_piece(piece, ids);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  FULCRUM_CHECK(is_valid_utf8(text), "cannot encode: the text is not valid UTF-8");
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3);
  for (const TextSegment& raw : added_.split(text, /*normalized=*/false)) {
    if (raw.id >= 0) {
      ids.push_back(raw.id);
      continue;
    }
    // Normalized added tokens are only found once the text is in the form they were written in.
    const std::string normalized = normalizer_.apply(raw.text);
    for (const TextSegment& seg : added_.split(normalized, /*normalized=*/true)) {
      if (seg.id >= 0) {
        ids.push_back(seg.id);
      } else {
        encode_plain(seg.text, ids);
      }
    }
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const int32_t id : ids) {
    if (const AddedToken* added = added_.find_id(id)) {
      if (!(added->special && skip_special_tokens)) bytes += byte_level_token_bytes(added->content);
      continue;
    }
    const std::string* token = model_.token_of(id);
    FULCRUM_CHECK(token != nullptr, "cannot decode: no token has id {} (ids are below {})", id, id_bound_);
    bytes += byte_level_token_bytes(*token);
  }
  return utf8_lossy(bytes);
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const AddedToken* added = added_.find_content(token)) return added->id;
  return model_.id_of(token);
}

}  // namespace fulcrum::tokenizer
