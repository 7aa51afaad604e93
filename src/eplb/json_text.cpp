#include "eplb/json_text.hpp"

#include "eplb/error.hpp"

namespace fulcrum::eplb {

std::optional<size_t> find_json_depth_overflow(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped byte cannot end the string
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"': in_string = true; break;
      case '[':
      case '{':
        if (++depth > max_depth) return i;
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;  // unbalanced closers are the parser's to report
        break;
      default: break;
    }
  }
  return std::nullopt;
}

namespace {

constexpr size_t kMaxQuotedBytes = 32;

// nlohmann's message ends "...; last read: '<token>'" (a parse error) or "number overflow parsing '<token>'", and
// the token can be a whole megabyte string: keep its start.
std::string shorten_last_read(std::string reason) {
  size_t token_begin = std::string::npos;
  for (const std::string marker : {"last read: '", "parsing '"}) {
    if (const size_t begin = reason.find(marker); begin != std::string::npos) {
      token_begin = begin + marker.size();
      break;
    }
  }
  if (token_begin == std::string::npos) return reason;
  const size_t token_end = reason.rfind('\'');
  if (token_end == std::string::npos || token_end < token_begin || token_end - token_begin <= kMaxQuotedBytes) {
    return reason;
  }
  reason.replace(token_begin, token_end - token_begin, reason.substr(token_begin, kMaxQuotedBytes) + "...");
  return reason;
}

}  // namespace

nlohmann::json parse_json_text(std::string_view text, const std::string& origin) {
  if (const auto at = find_json_depth_overflow(text)) {
    throw Error(fmt::format("{}: JSON nested deeper than {} levels (at byte {})", origin, kMaxJsonDepth, *at));
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // A parse_error, or an out_of_range for a number beyond the double range ("1e999"), which the parser throws
    // too and which once escaped as a non-fulcrum exception (found by fuzz/fuzz_loads).
    std::string reason = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix; keep its line/column and cause.
    if (const size_t end = reason.find("] "); reason.starts_with("[json.") && end != std::string::npos) {
      reason.erase(0, end + 2);
    }
    reason = shorten_last_read(std::move(reason));
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

std::string printable_excerpt(std::string_view text, size_t max_bytes) {
  std::string shown;
  for (size_t i = 0; i < text.size() && i < max_bytes; ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    shown += byte < 0x20 || byte >= 0x7f || byte == '\\' ? fmt::format("\\x{:02x}", byte) : std::string(1, text[i]);
  }
  if (text.size() > max_bytes) shown += "...";
  return shown;
}

std::string json_excerpt(const nlohmann::json& value, size_t max_bytes) {
  // A value from parse_json_text is at most kMaxJsonDepth deep, so dump() cannot overflow the stack; replace
  // invalid UTF-8 rather than throw.
  std::string text = value.dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
  if (text.size() > max_bytes) text = text.substr(0, max_bytes) + "...";
  return text;
}

}  // namespace fulcrum::eplb
