#pragma once
// HTTP/1.1 on the wire without sockets: requests parsed incrementally with limits, by http-parser (Debian's
// libhttp-parser, the parser Node.js shipped before llhttp; it decodes chunked bodies and tells where each
// pipelined request ends), and response heads written. http_transport.cpp feeds it the bytes it reads.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

struct http_parser;  // <http_parser.h>, included by http_wire.cpp only

namespace fulcrum::server {

// NOTES: what a request may take before it is refused. Header bytes count the request line and every
// header line (name, value, ": " and CRLF); body bytes count the decoded body, chunked or not, as they arrive
// (a Content-Length above the limit is refused before any body byte is read).
struct HttpLimits {
  size_t max_body_bytes = size_t{8} << 20;     // 413 beyond
  size_t max_header_bytes = size_t{64} << 10;  // 431 beyond (http-parser's own cap is 80 KiB)
  int max_headers = 100;                       // 431 beyond
};

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // as sent: path and query
  std::string path;    // target without the query
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased, in order
  std::string body;    // decoded (chunked bodies joined)
  bool keep_alive = true;  // HTTP/1.1 without "Connection: close", or HTTP/1.0 with keep-alive

  // The first header of that (lower-case) name, or "".
  const std::string& header(std::string_view name) const;
};

// One request at a time off a byte stream: feed() stops at the end of a request, so the bytes of the next
// pipelined one stay with the caller until take() has handed this one over.
class RequestParser {
 public:
  enum class State { kNeedMore, kComplete, kError };

  explicit RequestParser(const HttpLimits& limits);
  ~RequestParser();
  RequestParser(const RequestParser&) = delete;
  RequestParser& operator=(const RequestParser&) = delete;

  // Parses from `data`; returns the bytes consumed (fewer than `size` once a request is complete or on error).
  size_t feed(const char* data, size_t size);
  State state() const { return state_; }
  bool started() const { return started_; }  // a byte of the current request has been seen
  bool headers_done() const { return headers_done_; }
  // The client sent "Expect: 100-continue" and the body is within the limit: a "100 Continue" is due (once).
  bool take_continue_due();
  // On kError: the status to answer (400, 413, 431) and a one-line reason that quotes no client bytes.
  int error_status() const { return error_status_; }
  const std::string& error_message() const { return error_message_; }
  // The request so far: complete on kComplete; on kError what was parsed (for the access log).
  const HttpRequest& request() const { return request_; }
  // Hands the complete request over and starts on the next one.
  HttpRequest take();

 private:
  struct Callbacks;
  void fail(int status, std::string message);
  bool add_header_bytes(size_t n);

  const HttpLimits limits_;
  std::unique_ptr<::http_parser> parser_;
  State state_ = State::kNeedMore;
  HttpRequest request_;
  bool started_ = false, headers_done_ = false, continue_due_ = false, in_value_ = false;
  size_t header_bytes_ = 0;
  int error_status_ = 0;
  std::string error_message_;
};

const char* http_reason_phrase(int status);

// "HTTP/1.1 STATUS REASON\r\n" and the headers, ending with the blank line. `body_size` < 0: chunked.
std::string http_response_head(int status, const std::vector<std::pair<std::string, std::string>>& headers,
                               int64_t body_size, bool keep_alive);
// One chunk of a chunked body ("" gives nothing: the zero chunk ends the body, kLastChunk).
std::string http_chunk(std::string_view data);
inline constexpr std::string_view kLastChunk = "0\r\n\r\n";

}  // namespace fulcrum::server
