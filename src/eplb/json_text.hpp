#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace fulcrum::eplb {

// Parses JSON text; a syntax error becomes a one-line fulcrum::Error "origin: parse error at line L, column C: ...".
nlohmann::json parse_json_text(const std::string& text, const std::string& origin);

}  // namespace fulcrum::eplb
