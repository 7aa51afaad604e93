#pragma once
// Every JSON text the project reads (loads, placements, config.json, safetensors headers, tokenizer.json, request
// bodies) goes through here: nesting is bounded before nlohmann parses (its parser and its destructor recurse per
// level, so a 100k-deep `[[[...` overflows the stack), and errors stay one short line.
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace fulcrum::eplb {

// Deepest nesting of [ and { accepted. Our deepest real document is a load-window list (4 levels); safetensors
// headers and tokenizer.json stay under 8.
inline constexpr int kMaxJsonDepth = 256;

// Byte offset of the first [ or { that opens level max_depth + 1, or nullopt when the text never nests that deep.
// A linear scan: brackets inside strings (escapes honoured) do not count; the text need not be valid JSON.
std::optional<size_t> find_json_depth_overflow(std::string_view text, int max_depth = kMaxJsonDepth);

// Parses JSON text; throws a one-line fulcrum::Error naming `origin`: "origin: JSON nested deeper than 256 levels
// (at byte B)" before parsing, or "origin: parse error at line L, column C: ..." (at most a few dozen input bytes
// quoted, as \xNN where not printable ASCII).
nlohmann::json parse_json_text(std::string_view text, const std::string& origin);

// Untrusted bytes (a client's, a file's) for an error message: at most `max_bytes`, anything but printable ASCII
// (and the backslash) as \xNN, "..." when cut; never a line break, whatever the input.
std::string printable_excerpt(std::string_view text, size_t max_bytes = 64);

// A JSON value for an error message: its dump, cut to `max_bytes` with "..." (a value may be megabytes).
std::string json_excerpt(const nlohmann::json& value, size_t max_bytes = 40);

}  // namespace fulcrum::eplb
