#pragma once
// Token ids given on the command line ("1 2 3"), checked against the vocabulary.
#include <cstdint>
#include <string>
#include <vector>

namespace fulcrum::cli {

// Whitespace-separated ids, each in [0, id_bound); errors name `what` (e.g. "--prompt-tokens #2").
std::vector<int32_t> parse_token_ids(const std::string& text, const std::string& what, int64_t id_bound);

}  // namespace fulcrum::cli
