#include "eplb/json_text.hpp"

#include "eplb/error.hpp"

namespace fulcrum::eplb {

nlohmann::json parse_json_text(const std::string& text, const std::string& origin) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    std::string reason = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix; keep its line/column and cause.
    if (const size_t end = reason.find("] "); reason.starts_with("[json.") && end != std::string::npos) {
      reason.erase(0, end + 2);
    }
    throw Error(fmt::format("{}: {}", origin, reason));
  }
}

}  // namespace fulcrum::eplb
