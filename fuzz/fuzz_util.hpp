#pragma once
// What every harness checks: a parser either returns or throws a fulcrum::Error whose message is one short line.
// Any other exception (a nlohmann type_error, std::out_of_range, ...) escaping a parser is a bug the fuzzer
// reports, like a crash: the CLI and the server only promise one-line errors for fulcrum::Error.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string_view>

#include "eplb/error.hpp"

namespace fulcrum::fuzz {

// Longest error message accepted: errors quote excerpts of the input, never the input itself.
inline constexpr size_t kMaxErrorBytes = 1024;

[[noreturn]] inline void fail(const char* what, std::string_view message) {
  std::fprintf(stderr, "fuzz: %s: %.*s\n", what, static_cast<int>(std::min<size_t>(message.size(), 4096)),
               message.data());
  std::abort();
}

inline void check_error_message(std::string_view message) {
  if (message.empty()) fail("empty error message", message);
  if (message.find('\n') != std::string_view::npos) fail("error message of several lines", message);
  if (message.size() > kMaxErrorBytes) fail("error message over 1 KiB", message);
}

// Runs `parse`; a fulcrum::Error is an accepted outcome (its message checked), anything else thrown aborts.
template <typename F>
bool parses(F&& parse) {
  try {
    parse();
    return true;
  } catch (const Error& e) {
    check_error_message(e.what());
    return false;
  } catch (const std::exception& e) {
    fail("exception other than fulcrum::Error", e.what());
  }
}

}  // namespace fulcrum::fuzz
