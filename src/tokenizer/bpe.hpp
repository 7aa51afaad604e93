#pragma once
// The BPE "model" of tokenizer.json: a vocabulary and ranked merges. Each pre-tokenized piece starts as
// one symbol per character and the lowest-ranked adjacent pair is merged until none applies.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace fulcrum::tokenizer {

// Hash and equality that let unordered_map<std::string, ...> be searched with a string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// Token ids a tokenizer.json may use: [0, kMaxTokenIds). 100x the largest real vocabulary (Qwen3: 151k); the
// decoder's table is sized by the largest id, so a file naming id 2^31 would otherwise allocate gigabytes.
inline constexpr int64_t kMaxTokenIds = int64_t{1} << 24;

class BpeModel {
 public:
  // `file` only names the source in errors.
  static BpeModel from_json(const nlohmann::json& model, const std::string& file);

  // Appends the ids of one piece. Pieces seen before come from a cache.
  void encode_piece(std::string_view piece, std::vector<int32_t>& ids) const;

  std::optional<int32_t> id_of(std::string_view token) const;
  const std::string* token_of(int32_t id) const;  // nullptr when no token has this id
  int32_t id_bound() const { return static_cast<int32_t>(tokens_.size()); }  // all ids are below this

 private:
  struct Merge {
    uint32_t rank;
    int32_t id;  // of the merged token
  };
  struct Cache;

  std::vector<int32_t> merge_word(std::string_view word) const;
  std::optional<Merge> merge_of(int32_t left, int32_t right) const;

  StringMap<int32_t> vocab_;
  std::vector<std::string> tokens_;  // by id; "" where an id is unused
  std::vector<bool> has_token_;
  std::unordered_map<uint64_t, Merge> merges_;  // key: left id << 32 | right id
  std::optional<int32_t> unk_;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  std::shared_ptr<Cache> cache_;
};

}  // namespace fulcrum::tokenizer
