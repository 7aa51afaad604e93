#pragma once
// One way to fail: an exception carrying a one-line message; the CLI prints it and exits non-zero.
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace fulcrum {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace fulcrum

// FULCRUM_CHECK(cond, "fmt {}", args...): throws fulcrum::Error with the formatted message.
#define FULCRUM_CHECK(cond, ...)                                  \
  do {                                                            \
    if (!(cond)) throw ::fulcrum::Error(fmt::format(__VA_ARGS__)); \
  } while (0)
