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
    // The parser quotes the bytes it last read, raw: a corrupt file's bytes would make the message invalid UTF-8
    // (or break its line). Show them as \xNN.
    std::string shown;
    for (const char c : reason) {
      const auto byte = static_cast<unsigned char>(c);
      shown += byte < 0x20 || byte >= 0x7f ? fmt::format("\\x{:02x}", byte) : std::string(1, c);
    }
    throw Error(fmt::format("{}: {}", origin, shown));
  }
}

}  // namespace fulcrum::eplb
