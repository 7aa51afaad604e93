#pragma once
// A request the server refuses: the HTTP status and the OpenAI-style error type travel with the message,
// so the HTTP layer answers {"error": {"message": ..., "type": ...}} with that status.
#include <string>

#include "eplb/error.hpp"

namespace fulcrum::server {

class ApiError : public Error {
 public:
  ApiError(int status, std::string type, const std::string& message)
      : Error(message), status_(status), type_(std::move(type)) {}
  int status() const { return status_; }
  const std::string& type() const { return type_; }

 private:
  int status_;
  std::string type_;
};

// 400 invalid_request_error with a formatted message.
#define FULCRUM_REQUIRE(cond, ...)                                                                         \
  do {                                                                                                     \
    if (!(cond)) throw ::fulcrum::server::ApiError(400, "invalid_request_error", fmt::format(__VA_ARGS__)); \
  } while (0)

}  // namespace fulcrum::server
