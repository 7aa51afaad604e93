#include "tokenizer/added_tokens.hpp"

#include <algorithm>

#include "eplb/error.hpp"
#include "tokenizer/unicode.hpp"

namespace fulcrum::tokenizer {
namespace {

size_t previous_char_start(std::string_view s, size_t i) {
  do {
    --i;
  } while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80);
  return i;
}

char32_t char_before(std::string_view s, size_t i) {
  size_t start = previous_char_start(s, i);
  return next_code_point(s, start);
}

char32_t char_at(std::string_view s, size_t i) { return next_code_point(s, i); }

}  // namespace

void AddedVocabulary::add(AddedToken token, std::string pattern) {
  FULCRUM_CHECK(!pattern.empty(), "added token {} has empty content", token.id);
  auto& bucket = by_first_byte_[static_cast<unsigned char>(pattern[0])];
  FULCRUM_CHECK(!by_id_.contains(token.id), "added token id {} appears twice", token.id);
  by_id_[token.id] = tokens_.size();
  tokens_.push_back(std::move(token));
  patterns_.push_back(std::move(pattern));
  bucket.push_back(tokens_.size() - 1);
  std::stable_sort(bucket.begin(), bucket.end(),
                   [&](size_t a, size_t b) { return patterns_[a].size() > patterns_[b].size(); });
}

const AddedToken* AddedVocabulary::find_id(int32_t id) const {
  const auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &tokens_[it->second];
}

const AddedToken* AddedVocabulary::find_content(std::string_view content) const {
  for (const AddedToken& t : tokens_) {
    if (t.content == content) return &t;
  }
  return nullptr;
}

std::vector<TextSegment> AddedVocabulary::split(std::string_view text, bool normalized) const {
  std::vector<TextSegment> segments;
  size_t plain_start = 0;  // where the pending run of plain text begins
  size_t i = 0;
  while (i < text.size()) {
    const AddedToken* match = nullptr;
    size_t length = 0;
    for (const size_t index : by_first_byte_[static_cast<unsigned char>(text[i])]) {
      if (tokens_[index].normalized == normalized && text.substr(i).starts_with(patterns_[index])) {
        match = &tokens_[index];
        length = patterns_[index].size();
        break;
      }
    }
    if (!match) {
      ++i;
      continue;
    }
    size_t start = i, end = i + length;
    if (match->single_word && ((start > 0 && is_word_char(char_before(text, start))) ||
                               (end < text.size() && is_word_char(char_at(text, end))))) {
      i = end;  // a rejected match is not searched again for shorter tokens inside it
      continue;
    }
    while (match->lstrip && start > plain_start && is_unicode_space(char_before(text, start))) {
      start = previous_char_start(text, start);
    }
    while (match->rstrip && end < text.size() && is_unicode_space(char_at(text, end))) {
      size_t next = end;
      next_code_point(text, next);
      end = next;
    }
    if (start > plain_start) segments.push_back({text.substr(plain_start, start - plain_start), -1});
    segments.push_back({text.substr(start, end - start), match->id});
    plain_start = i = end;
  }
  if (plain_start < text.size()) segments.push_back({text.substr(plain_start), -1});
  return segments;
}

}  // namespace fulcrum::tokenizer
