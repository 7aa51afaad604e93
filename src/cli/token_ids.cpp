#include "cli/token_ids.hpp"

#include <sstream>

#include "eplb/error.hpp"

namespace fulcrum::cli {

std::vector<int32_t> parse_token_ids(const std::string& text, const std::string& what, int64_t id_bound) {
  std::vector<int32_t> ids;
  std::istringstream in(text);
  std::string word;
  while (in >> word) {
    size_t used = 0;
    long long id = -1;
    try {
      id = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    FULCRUM_CHECK(used == word.size(), "{}: '{}' is not a token id", what, word);
    FULCRUM_CHECK(id >= 0 && id < id_bound, "{}: token id {} out of range [0, {})", what, id, id_bound);
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

}  // namespace fulcrum::cli
