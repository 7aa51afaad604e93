#include "tokenizer/bpe.hpp"

#include <mutex>
#include <queue>

#include "eplb/error.hpp"
#include "eplb/json_text.hpp"
#include "tokenizer/unicode.hpp"

namespace fulcrum::tokenizer {
namespace {

// Short pieces repeat (words, spaces); long ones rarely do and would only bloat the cache.
constexpr size_t kMaxCachedPieceBytes = 64;
constexpr size_t kMaxCacheEntries = 1 << 17;

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

std::pair<std::string, std::string> parse_merge(const nlohmann::json& entry, const std::string& file) {
  if (entry.is_array()) {
    FULCRUM_CHECK(entry.size() == 2, "{}: merge {} is not a pair", file, eplb::json_excerpt(entry));
    return {entry[0].get<std::string>(), entry[1].get<std::string>()};
  }
  const std::string text = entry.get<std::string>();
  const size_t space = text.find(' ');
  FULCRUM_CHECK(space != std::string::npos && text.find(' ', space + 1) == std::string::npos,
                "{}: merge '{}' is not two tokens separated by one space", file,
                eplb::printable_excerpt(text));
  return {text.substr(0, space), text.substr(space + 1)};
}

}  // namespace

struct BpeModel::Cache {
  std::mutex mutex;
  StringMap<std::vector<int32_t>> words;
};

BpeModel BpeModel::from_json(const nlohmann::json& model, const std::string& file) {
  const std::string type = model.value("type", std::string("BPE"));
  FULCRUM_CHECK(type == "BPE", "{}: unsupported model type '{}' (supported: BPE)", file, eplb::printable_excerpt(type));
  const auto null_or = [&](const char* key, auto accepted) {
    return !model.contains(key) || model[key].is_null() || model[key] == accepted;
  };
  FULCRUM_CHECK(null_or("dropout", 0.0), "{}: BPE dropout is not supported", file);
  FULCRUM_CHECK(null_or("continuing_subword_prefix", ""), "{}: BPE continuing_subword_prefix is not supported", file);
  FULCRUM_CHECK(null_or("end_of_word_suffix", ""), "{}: BPE end_of_word_suffix is not supported", file);
  FULCRUM_CHECK(null_or("byte_fallback", false), "{}: BPE byte_fallback is not supported", file);

  BpeModel m;
  for (const auto& [token, id_json] : model.at("vocab").items()) {
    // An integer first: get<int64_t>() of a float beyond int64 is undefined behaviour (found by fuzz/fuzz_tokenizer_json).
    FULCRUM_CHECK(id_json.is_number_integer(), "{}: vocab id of '{}' is not an integer: {}", file,
                  eplb::printable_excerpt(token), eplb::json_excerpt(id_json));
    const int64_t id = id_json.get<int64_t>();
    FULCRUM_CHECK(id >= 0 && id < kMaxTokenIds, "{}: vocab id {} of '{}' is outside [0, {})", file, id,
                  eplb::printable_excerpt(token), kMaxTokenIds);
    m.vocab_[token] = static_cast<int32_t>(id);
    if (static_cast<size_t>(id) >= m.tokens_.size()) {
      m.tokens_.resize(id + 1);
      m.has_token_.resize(id + 1, false);
    }
    m.tokens_[id] = token;
    m.has_token_[id] = true;
  }
  const nlohmann::json& merges = model.at("merges");
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto [left, right] = parse_merge(merges[rank], file);
    const auto l = m.id_of(left), r = m.id_of(right), merged = m.id_of(left + right);
    FULCRUM_CHECK(l && r && merged, "{}: merge '{} {}' uses a token missing from the vocab", file,
                  eplb::printable_excerpt(left), eplb::printable_excerpt(right));
    m.merges_.insert_or_assign(pair_key(*l, *r), Merge{static_cast<uint32_t>(rank), *merged});
  }
  if (model.contains("unk_token") && !model["unk_token"].is_null()) {
    const std::string unk = model["unk_token"].get<std::string>();
    m.unk_ = m.id_of(unk);
    FULCRUM_CHECK(m.unk_.has_value(), "{}: unk_token '{}' is not in the vocab", file, eplb::printable_excerpt(unk));
  }
  m.fuse_unk_ = model.value("fuse_unk", false);
  m.ignore_merges_ = model.value("ignore_merges", false);
  m.cache_ = std::make_shared<Cache>();
  return m;
}

std::optional<int32_t> BpeModel::id_of(std::string_view token) const {
  const auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::token_of(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= tokens_.size() || !has_token_[id]) return nullptr;
  return &tokens_[id];
}

std::optional<BpeModel::Merge> BpeModel::merge_of(int32_t left, int32_t right) const {
  const auto it = merges_.find(pair_key(left, right));
  if (it == merges_.end()) return std::nullopt;
  return it->second;
}

std::vector<int32_t> BpeModel::merge_word(std::string_view word) const {
  if (ignore_merges_) {
    if (const auto whole = id_of(word)) return {*whole};
  }
  // Symbols form a linked list over the characters; merging unlinks the right one.
  struct Symbol {
    int32_t id;
    int prev, next;
  };
  std::vector<Symbol> symbols;
  for (size_t i = 0; i < word.size();) {
    const size_t start = i;
    next_code_point(word, i);
    std::optional<int32_t> id = id_of(word.substr(start, i - start));
    if (!id) {
      if (!unk_) continue;  // like HF: with no unk token a character outside the vocab is dropped
      if (fuse_unk_ && !symbols.empty() && symbols.back().id == *unk_) continue;
      id = unk_;
    }
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({*id, index - 1, index + 1});
  }
  if (symbols.empty()) return {};
  symbols.back().next = -1;

  // Lowest rank first, then leftmost; entries that went stale are skipped when popped.
  struct Candidate {
    uint32_t rank;
    int left;
    int32_t left_id, right_id, merged_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto push = [&](int left) {
    if (left < 0 || symbols[left].next < 0) return;
    const Symbol& l = symbols[left];
    if (const auto merge = merge_of(l.id, symbols[l.next].id)) {
      queue.push({merge->rank, left, l.id, symbols[l.next].id, merge->id});
    }
  };
  for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) push(i);
  std::vector<bool> alive(symbols.size(), true);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = symbols[c.left];
    if (!alive[c.left] || left.next < 0 || left.id != c.left_id || symbols[left.next].id != c.right_id) continue;
    const int right = left.next;
    alive[right] = false;
    left.id = c.merged_id;
    left.next = symbols[right].next;
    if (left.next >= 0) symbols[left.next].prev = c.left;
    push(left.prev);
    push(c.left);
  }
  std::vector<int32_t> ids;
  for (int i = 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
  return ids;
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>& ids) const {
  const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_->mutex);
    const auto it = cache_->words.find(piece);
    if (it != cache_->words.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> word_ids = merge_word(piece);
  ids.insert(ids.end(), word_ids.begin(), word_ids.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_->mutex);
    if (cache_->words.size() < kMaxCacheEntries) cache_->words.emplace(piece, std::move(word_ids));
  }
}

}  // namespace fulcrum::tokenizer
