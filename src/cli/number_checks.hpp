#pragma once
// Flag checks that name their rule: CLI11 2.1's PositiveNumber reports a 0 as "Value 0 not in range 0.000000 to
// 17976931348623157...", a 300-digit line that reads as if 0 were allowed. Every rule here also wants a finite
// number: "nan", "inf" and values past the double range are refused.
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

#include <CLI/CLI.hpp>

namespace fulcrum::cli {

namespace detail {
template <typename Rule>
CLI::Validator number_check(const std::string& rule, Rule ok) {
  return CLI::Validator(
      [rule, ok](std::string& text) -> std::string {
        errno = 0;
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE || std::isnan(v)) {
          return "'" + text + "' is not a number";
        }
        if (!std::isfinite(v)) return "must be a finite number, got " + text;
        return ok(v) ? std::string() : "must be " + rule + ", got " + text;
      },
      rule, "");
}
}  // namespace detail

inline const CLI::Validator kPositive = detail::number_check("positive", [](double v) { return v > 0; });
inline const CLI::Validator kNonNegative = detail::number_check("zero or more", [](double v) { return v >= 0; });

}  // namespace fulcrum::cli
