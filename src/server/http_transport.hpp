#pragma once
// The event-driven HTTP/1.1 front end: one thread runs an epoll loop over the listening socket and every
// connection (non-blocking sockets), so an idle keep-alive socket, a client dripping its headers or a long
// stream costs a file descriptor and a few KiB, never a thread. Handlers run on the loop thread and must not
// block: a response that takes time (generation) is a DeferredBody the loop polls whenever its wake() is
// called and at least once a second. Pipelined requests are answered in order, one at a time.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "server/http_wire.hpp"

namespace fulcrum::server {

struct HttpTransportOptions {
  HttpLimits limits;
  int max_connections = 4096;     // beyond: 503 with Retry-After, then closed
  double header_timeout_s = 10;   // first byte of a request to the end of its headers (408 beyond)
  double idle_timeout_s = 60;     // a keep-alive connection with no request, or a body with no byte, is closed
  double request_timeout_s = 0;   // > 0: a deferred response past it is cancelled (DeferredBody::cancel(true))
};

// The rest of a response that is not ready when its handler returns. Called on the loop thread only.
class DeferredBody {
 public:
  virtual ~DeferredBody() = default;
  // Streamed responses (HttpResponse::stream): sets `out.body` to the bytes to send now. Otherwise fills `out`
  // (status, headers, body) once ready. True when the response is complete. `out` starts empty.
  virtual bool poll(struct HttpResponse& out) = 0;
  // The client went away (`timed_out` false; the response is dropped) or the request outlived
  // --request-timeout (true; the next poll() must complete the response with an error).
  virtual void cancel(bool timed_out) = 0;
  virtual int64_t tokens() const = 0;  // generated so far, for the access log
};

struct HttpResponse {
  int status = 200;
  std::vector<std::pair<std::string, std::string>> headers;  // Content-Type among them
  std::string body;
  bool stream = false;  // chunked: the head now, then the bytes `deferred` gives; else `headers` join its answer
  std::shared_ptr<DeferredBody> deferred;
  bool rejected = false;  // refused before running (counted in fulcrum_requests_rejected_total)
};

// What the access log and the metrics hear of each answered request, on the loop thread.
struct HttpExchange {
  const HttpRequest& request;
  int status;
  double seconds;  // from the end of the request to the last byte queued
  int64_t tokens;
  bool rejected;
};

// thread-safe; after the connection is gone it does nothing.
using HttpWake = std::function<void()>;
using HttpHandler = std::function<HttpResponse(const HttpRequest&, const HttpWake&)>;

class HttpTransport {
 public:
  HttpTransport(HttpTransportOptions options, HttpHandler handler, std::function<void(const HttpExchange&)> on_answered);
  ~HttpTransport();
  HttpTransport(const HttpTransport&) = delete;
  HttpTransport& operator=(const HttpTransport&) = delete;

  // Binds host:port exclusively (SO_REUSEADDR, not SO_REUSEPORT) and returns the port (0: any free one).
  int bind(const std::string& host, int port);
  // Runs the loop until stop(); every connection is closed when it returns.
  void run();
  // From any thread, also before run(): run() returns soon (or at once), cancelling deferred responses.
  void stop();
  // Connections with a response not yet fully written (deferred, streaming or unsent bytes).
  int responses_in_progress() const;
  int open_connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fulcrum::server
