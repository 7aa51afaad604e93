#include "tokenizer/pre_tokenizer.hpp"

#include <algorithm>

#include "eplb/error.hpp"
#include "eplb/json_text.hpp"
#include "tokenizer/byte_level.hpp"

namespace fulcrum::tokenizer {
namespace {

// GPT-2's split, which ByteLevel applies itself when use_regex is set.
const Regex& gpt2_pattern() {
  static const Regex pattern(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)");
  return pattern;
}

SplitBehavior parse_behavior(const std::string& name, const std::string& file) {
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  FULCRUM_CHECK(false, "{}: unsupported Split behavior '{}'", file, eplb::printable_excerpt(name));
  return SplitBehavior::kIsolated;
}

}  // namespace

std::vector<std::string> split_by(std::string_view text, const Regex& pattern, SplitBehavior behavior, bool invert) {
  struct Segment {
    size_t begin, end;
    bool match;
  };
  std::vector<Segment> segments;
  size_t last = 0;
  for (const auto& [begin, end] : pattern.find_all(text)) {
    if (begin > last) segments.push_back({last, begin, invert});
    segments.push_back({begin, end, !invert});
    last = end;
  }
  if (last < text.size()) segments.push_back({last, text.size(), invert});

  // A delimiter joins its neighbour only when that neighbour is not a delimiter itself.
  std::vector<std::pair<size_t, size_t>> pieces;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Segment& s : segments) pieces.emplace_back(s.begin, s.end);
      break;
    case SplitBehavior::kRemoved:
      for (const Segment& s : segments) {
        if (!s.match) pieces.emplace_back(s.begin, s.end);
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Segment& s : segments) {
        if (s.match && !previous_match && !pieces.empty()) {
          pieces.back().second = s.end;
        } else {
          pieces.emplace_back(s.begin, s.end);
        }
        previous_match = s.match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto s = segments.rbegin(); s != segments.rend(); ++s) {
        if (s->match && !previous_match && !pieces.empty()) {
          pieces.back().first = s->begin;
        } else {
          pieces.emplace_back(s->begin, s->end);
        }
        previous_match = s->match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    case SplitBehavior::kContiguous:
      for (const Segment& s : segments) {
        if (s.match && previous_match) {
          pieces.back().second = s.end;
        } else {
          pieces.emplace_back(s.begin, s.end);
        }
        previous_match = s.match;
      }
      break;
  }
  std::vector<std::string> out;
  out.reserve(pieces.size());
  for (const auto& [begin, end] : pieces) out.emplace_back(text.substr(begin, end - begin));
  return out;
}

void PreTokenizer::add_steps(const nlohmann::json& spec, const std::string& file, std::vector<Step>& steps) {
  if (spec.is_null()) return;
  FULCRUM_CHECK(spec.is_object() && spec.contains("type"), "{}: pre_tokenizer without a type", file);
  const std::string type = spec["type"].get<std::string>();
  Step step;
  if (type == "Sequence") {
    for (const auto& inner : spec.at("pretokenizers")) add_steps(inner, file, steps);
    return;
  } else if (type == "Split") {
    const auto& pattern = spec.at("pattern");
    if (pattern.contains("Regex")) {
      step.pattern = std::make_shared<const Regex>(pattern["Regex"].get<std::string>());
    } else {
      FULCRUM_CHECK(pattern.contains("String"), "{}: Split pattern is neither Regex nor String", file);
      step.pattern = std::make_shared<const Regex>(pattern["String"].get<std::string>(), /*literal=*/true);
    }
    step.behavior = parse_behavior(spec.at("behavior").get<std::string>(), file);
    step.invert = spec.value("invert", false);
  } else if (type == "ByteLevel") {
    step.byte_level = true;
    step.add_prefix_space = spec.value("add_prefix_space", true);
    step.use_regex = spec.value("use_regex", true);
  } else {
    FULCRUM_CHECK(false, "{}: unsupported pre_tokenizer '{}' (supported: Split, ByteLevel, Sequence)", file,
                  eplb::printable_excerpt(type));
  }
  steps.push_back(std::move(step));
}

PreTokenizer PreTokenizer::from_json(const nlohmann::json& spec, const std::string& file) {
  PreTokenizer p;
  add_steps(spec, file, p.steps_);
  return p;
}

std::vector<std::string> PreTokenizer::apply(const Step& step, std::vector<std::string> pieces) {
  std::vector<std::string> out;
  for (std::string& piece : pieces) {
    if (!step.byte_level) {
      for (std::string& part : split_by(piece, *step.pattern, step.behavior, step.invert)) out.push_back(std::move(part));
      continue;
    }
    // HF adds the prefix space to every piece that reaches ByteLevel, not only to the first.
    if (step.add_prefix_space && (piece.empty() || piece[0] != ' ')) piece.insert(piece.begin(), ' ');
    if (step.use_regex) {
      for (const std::string& part : split_by(piece, gpt2_pattern(), SplitBehavior::kIsolated, false)) {
        out.push_back(bytes_to_byte_level(part));
      }
    } else {
      out.push_back(bytes_to_byte_level(piece));
    }
  }
  return out;
}

std::vector<std::string> PreTokenizer::split(std::string_view text) const {
  std::vector<std::string> pieces;
  if (!text.empty()) pieces.emplace_back(text);
  for (const Step& step : steps_) pieces = apply(step, std::move(pieces));
  return pieces;
}

}  // namespace fulcrum::tokenizer
