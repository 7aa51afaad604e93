#pragma once
// The "pre_tokenizer" of tokenizer.json: Split (a regex or a literal) and ByteLevel steps, alone or in a
// Sequence. It cuts normalized text into the pieces that BPE encodes independently.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/regex.hpp"

namespace fulcrum::tokenizer {

// What Split does with the text its pattern matches (HF's SplitDelimiterBehavior).
enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

class PreTokenizer {
 public:
  PreTokenizer() = default;  // no steps: the whole text is one piece
  // `file` only names the source in errors about unsupported steps.
  static PreTokenizer from_json(const nlohmann::json& spec, const std::string& file);

  std::vector<std::string> split(std::string_view text) const;

 private:
  struct Step {
    bool byte_level = false;  // else a Split step
    std::shared_ptr<const Regex> pattern;  // Split's pattern
    SplitBehavior behavior = SplitBehavior::kIsolated;
    bool invert = false;
    bool add_prefix_space = false;  // ByteLevel's flags
    bool use_regex = false;
  };
  static void add_steps(const nlohmann::json& spec, const std::string& file, std::vector<Step>& steps);
  static std::vector<std::string> apply(const Step& step, std::vector<std::string> pieces);

  std::vector<Step> steps_;
};

// Cuts `text` around the matches of `pattern` as `behavior` says (invert: the matches are the pieces kept
// and the text between them is what `behavior` applies to). Empty pieces are dropped.
std::vector<std::string> split_by(std::string_view text, const Regex& pattern, SplitBehavior behavior, bool invert);

}  // namespace fulcrum::tokenizer
