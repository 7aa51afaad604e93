#include "server/http_wire.hpp"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>
#include <http_parser.h>

namespace fulcrum::server {

const std::string& HttpRequest::header(std::string_view name) const {
  static const std::string none;
  for (const auto& [key, value] : headers) {
    if (key == name) return value;
  }
  return none;
}

// http-parser calls these with the parser; `data` points back at the RequestParser. A non-zero return stops it.
struct RequestParser::Callbacks {
  static RequestParser& self(http_parser* p) { return *static_cast<RequestParser*>(p->data); }

  static int on_message_begin(http_parser* p) {
    self(p).started_ = true;
    return 0;
  }
  static int on_url(http_parser* p, const char* at, size_t n) {
    RequestParser& s = self(p);
    if (!s.add_header_bytes(n)) return -1;
    s.request_.target.append(at, n);
    return 0;
  }
  static int on_header_field(http_parser* p, const char* at, size_t n) {
    RequestParser& s = self(p);
    if (s.request_.headers.empty() || s.in_value_) {
      if (static_cast<int>(s.request_.headers.size()) >= s.limits_.max_headers) {
        s.fail(431, fmt::format("more than {} request headers", s.limits_.max_headers));
        return -1;
      }
      s.request_.headers.emplace_back();
      s.in_value_ = false;
      if (!s.add_header_bytes(4)) return -1;  // ": " and CRLF
    }
    if (!s.add_header_bytes(n)) return -1;
    std::string& name = s.request_.headers.back().first;
    for (size_t i = 0; i < n; ++i) name += static_cast<char>(std::tolower(static_cast<unsigned char>(at[i])));
    return 0;
  }
  static int on_header_value(http_parser* p, const char* at, size_t n) {
    RequestParser& s = self(p);
    s.in_value_ = true;
    if (!s.add_header_bytes(n)) return -1;
    s.request_.headers.back().second.append(at, n);
    return 0;
  }
  static int on_headers_complete(http_parser* p) {
    RequestParser& s = self(p);
    s.headers_done_ = true;
    HttpRequest& r = s.request_;
    r.method = http_method_str(static_cast<http_method>(p->method));
    r.path = r.target.substr(0, r.target.find('?'));
    r.keep_alive = http_should_keep_alive(p) != 0;
    if ((p->flags & F_CONTENTLENGTH) != 0 && p->content_length > s.limits_.max_body_bytes) {
      s.fail(413, fmt::format("the request body is over the limit of {} bytes", s.limits_.max_body_bytes));
      return 3;  // neither 0, 1 nor 2: an error that stops the parser
    }
    std::string expect = r.header("expect");
    std::transform(expect.begin(), expect.end(), expect.begin(), [](unsigned char c) { return std::tolower(c); });
    s.continue_due_ = expect == "100-continue";
    return 0;
  }
  static int on_body(http_parser* p, const char* at, size_t n) {
    RequestParser& s = self(p);
    if (s.request_.body.size() + n > s.limits_.max_body_bytes) {
      s.fail(413, fmt::format("the request body is over the limit of {} bytes", s.limits_.max_body_bytes));
      return -1;
    }
    s.request_.body.append(at, n);
    return 0;
  }
  static int on_message_complete(http_parser* p) {
    self(p).state_ = State::kComplete;
    http_parser_pause(p, 1);  // the next pipelined request waits for take()
    return 0;
  }

  static const http_parser_settings& settings() {
    static const http_parser_settings s = [] {
      http_parser_settings out{};
      out.on_message_begin = on_message_begin;
      out.on_url = on_url;
      out.on_header_field = on_header_field;
      out.on_header_value = on_header_value;
      out.on_headers_complete = on_headers_complete;
      out.on_body = on_body;
      out.on_message_complete = on_message_complete;
      return out;
    }();
    return s;
  }
};

RequestParser::RequestParser(const HttpLimits& limits) : limits_(limits), parser_(std::make_unique<http_parser>()) {
  http_parser_init(parser_.get(), HTTP_REQUEST);
  parser_->data = this;
}

RequestParser::~RequestParser() = default;

void RequestParser::fail(int status, std::string message) {
  if (state_ == State::kError) return;
  state_ = State::kError;
  error_status_ = status;
  error_message_ = std::move(message);
}

bool RequestParser::add_header_bytes(size_t n) {
  header_bytes_ += n;
  if (header_bytes_ <= limits_.max_header_bytes) return true;
  fail(431, fmt::format("the request line and headers are over the limit of {} bytes", limits_.max_header_bytes));
  return false;
}

size_t RequestParser::feed(const char* data, size_t size) {
  if (state_ != State::kNeedMore || size == 0) return 0;
  const size_t consumed = http_parser_execute(parser_.get(), &Callbacks::settings(), data, size);
  const auto err = static_cast<http_errno>(parser_->http_errno);
  if (state_ == State::kNeedMore && err != HPE_OK && err != HPE_PAUSED) {
    if (err == HPE_HEADER_OVERFLOW) {
      fail(431, fmt::format("the request line and headers are over the limit of {} bytes", limits_.max_header_bytes));
    } else {
      fail(400, fmt::format("malformed HTTP request: {}", http_errno_description(err)));
    }
  }
  return consumed;
}

bool RequestParser::take_continue_due() {
  const bool due = continue_due_ && state_ != State::kError;
  continue_due_ = false;
  return due;
}

HttpRequest RequestParser::take() {
  HttpRequest out = std::move(request_);
  request_ = HttpRequest{};
  state_ = State::kNeedMore;
  started_ = headers_done_ = continue_due_ = in_value_ = false;
  header_bytes_ = 0;
  http_parser_pause(parser_.get(), 0);
  return out;
}

const char* http_reason_phrase(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "Unknown";
  }
}

std::string http_response_head(int status, const std::vector<std::pair<std::string, std::string>>& headers,
                               int64_t body_size, bool keep_alive) {
  std::string out = fmt::format("HTTP/1.1 {} {}\r\n", status, http_reason_phrase(status));
  for (const auto& [name, value] : headers) out += fmt::format("{}: {}\r\n", name, value);
  out += body_size < 0 ? std::string("Transfer-Encoding: chunked\r\n") : fmt::format("Content-Length: {}\r\n", body_size);
  out += keep_alive ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
  return out;
}

std::string http_chunk(std::string_view data) {
  if (data.empty()) return {};
  return fmt::format("{:x}\r\n{}\r\n", data.size(), data);
}

}  // namespace fulcrum::server
