#include "server/http_transport.hpp"

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include "eplb/error.hpp"
#include "server/responses.hpp"

namespace fulcrum::server {
namespace {

using Clock = std::chrono::steady_clock;

// NOTES: buffers are bounded per connection. While a response is in progress, pipelined bytes are read up to
// kMaxBufferedInput and then reading pauses; answered-but-unread output above kMaxPendingOutput pauses the
// answering of further pipelined requests until the client reads. A connection closed after an error
// response lingers (discarding input) for up to kLingerSeconds / kLingerBytes, so that the client, which may
// still be sending its body, reads the response instead of a reset.
constexpr size_t kReadChunk = size_t{64} << 10;
constexpr int kReadsPerEvent = 4;  // then other connections get their turn
constexpr size_t kMaxBufferedInput = size_t{1} << 20;
constexpr size_t kMaxPendingOutput = size_t{1} << 20;
constexpr double kLingerSeconds = 2;
constexpr size_t kLingerBytes = size_t{64} << 20;
constexpr int kMaxRefusedLingering = 1024;  // connections over --max-connections still lingering; beyond: closed at once
constexpr auto kScanInterval = std::chrono::milliseconds(100);
constexpr auto kPollInterval = std::chrono::seconds(1);  // deferred bodies are polled at least this often
constexpr uint64_t kListenerId = 0, kWakeId = 1;

enum class Phase { kReading, kDeferred, kStreaming, kLingering };

double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct Connection {
  Connection(int f, uint64_t i, const HttpLimits& limits, Clock::time_point now)
      : fd(f), id(i), parser(limits), last_activity(now), request_begin(now) {}
  int fd;
  uint64_t id;
  RequestParser parser;
  std::string in;  // read, from in_pos on not parsed yet
  size_t in_pos = 0;
  std::string out;  // to send, from out_pos on
  size_t out_pos = 0;
  Phase phase = Phase::kReading;
  Clock::time_point last_activity, request_begin, answer_begin, last_poll, linger_until;
  HttpRequest request;    // the one being answered
  HttpResponse response;  // its deferred response
  bool timed_out = false, close_after = false, peer_closed = false, refused = false, busy = false;
  size_t lingered = 0;
  uint32_t events = 0;  // registered with epoll
};

// Wakes from other threads: connection ids, and an eventfd the loop waits on.
struct WakeQueue {
  std::mutex mutex;
  std::vector<uint64_t> ids;
  int event_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  ~WakeQueue() { ::close(event_fd); }
  void signal() {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(event_fd, &one, sizeof one);
  }
  void push(uint64_t id) {
    bool was_empty = false;
    {
      std::lock_guard lock(mutex);
      was_empty = ids.empty();
      ids.push_back(id);
    }
    if (was_empty) signal();
  }
};

const char* error_type(int status) {
  switch (status) {
    case 408: return "timeout";
    case 503: return "unavailable";
    default: return "invalid_request_error";
  }
}

HttpResponse internal_error(const std::string& message) {
  HttpResponse r;
  r.status = 500;
  r.headers = {{"Content-Type", "application/json"}};
  r.body = error_body(message, "internal_error").dump() + "\n";
  return r;
}

}  // namespace

struct HttpTransport::Impl {
  HttpTransportOptions options;
  HttpHandler handler;
  std::function<void(const HttpExchange&)> on_answered;
  int listen_fd = -1;
  int epoll_fd = -1;
  std::shared_ptr<WakeQueue> wakes = std::make_shared<WakeQueue>();
  std::unordered_map<uint64_t, std::unique_ptr<Connection>> conns;
  uint64_t next_id = 2;
  int num_counted = 0;  // connections within --max-connections (not the refused ones)
  int num_refused = 0;
  bool accept_paused = false;
  Clock::time_point accept_resume;
  std::atomic<bool> stopping{false};
  std::atomic<int> num_busy{0}, num_open{0};

  void set_events(Connection& c, uint32_t events) {
    if (events == c.events) return;
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = c.id;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c.fd, &ev);
    c.events = events;
  }

  void update_busy(Connection& c) {
    const bool busy = c.phase == Phase::kDeferred || c.phase == Phase::kStreaming || c.out_pos < c.out.size();
    if (busy != c.busy) num_busy += busy ? 1 : -1;
    c.busy = busy;
  }

  void close_connection(Connection& c) {
    if ((c.phase == Phase::kDeferred || c.phase == Phase::kStreaming) && c.response.deferred) c.response.deferred->cancel(false);
    if (c.busy) --num_busy;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_DEL, c.fd, nullptr);
    ::close(c.fd);
    (c.refused ? num_refused : num_counted) -= 1;
    --num_open;
    conns.erase(c.id);  // `c` is gone
  }

  HttpWake wake_for(uint64_t id) const {
    return [queue = std::weak_ptr<WakeQueue>(wakes), id] {
      if (const auto q = queue.lock()) q->push(id);
    };
  }

  void answered(Connection& c, const HttpRequest& request, int status, int64_t tokens, bool rejected) {
    if (on_answered) on_answered({request, status, seconds_between(c.answer_begin, Clock::now()), tokens, rejected});
  }

  void queue_whole(Connection& c, const HttpResponse& r, bool keep_alive) {
    c.out += http_response_head(r.status, r.headers, static_cast<int64_t>(r.body.size()), keep_alive);
    c.out += r.body;
    if (!keep_alive) c.close_after = true;
  }

  // A refusal by the transport itself (malformed, over a limit, too slow, too many connections); the
  // connection closes after it.
  void answer_error(Connection& c, int status, const std::string& message) {
    HttpResponse r;
    r.status = status;
    r.headers = {{"Content-Type", "application/json"}};
    if (status == 503) r.headers.emplace_back("Retry-After", "1");
    r.body = error_body(message, error_type(status)).dump() + "\n";
    c.answer_begin = Clock::now();
    queue_whole(c, r, false);
    answered(c, c.parser.request(), status, 0, true);
  }

  void begin_linger(Connection& c) {
    ::shutdown(c.fd, SHUT_WR);
    c.phase = Phase::kLingering;
    c.linger_until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kLingerSeconds));
    c.in.clear();
    c.in_pos = 0;
    set_events(c, c.peer_closed ? 0u : static_cast<uint32_t>(EPOLLIN | EPOLLRDHUP));
  }

  // Sends what it can; false when the connection was closed.
  bool flush(Connection& c) {
    while (c.out_pos < c.out.size()) {
      const ssize_t n = ::send(c.fd, c.out.data() + c.out_pos, c.out.size() - c.out_pos, MSG_NOSIGNAL);
      if (n > 0) {
        c.out_pos += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        break;
      } else {
        close_connection(c);
        return false;
      }
    }
    const bool pending = c.out_pos < c.out.size();
    if (!pending) {
      c.out.clear();
      c.out_pos = 0;
      if (c.close_after && c.phase == Phase::kReading) {
        if (c.peer_closed) {
          close_connection(c);
          return false;
        }
        begin_linger(c);
      }
    }
    if (c.phase != Phase::kLingering) {
      // Read while there is room for input; watch for the peer's close always (a gone client is cancelled).
      const bool room = c.phase == Phase::kReading ? !pending || c.out.size() - c.out_pos < kMaxPendingOutput
                                                   : c.in.size() - c.in_pos < kMaxBufferedInput;
      uint32_t events = c.peer_closed ? 0u : EPOLLRDHUP | (room && !c.close_after ? static_cast<uint32_t>(EPOLLIN) : 0u);
      if (pending) events |= EPOLLOUT;
      set_events(c, events);
    }
    update_busy(c);
    return true;
  }

  // Polls the deferred response; true when it completed (the connection is back to reading).
  bool poll_deferred(Connection& c) {
    const std::shared_ptr<DeferredBody> body = c.response.deferred;  // poll() may not outlive it
    HttpResponse out;
    c.last_poll = Clock::now();
    bool done = false;
    try {
      done = body->poll(out);
      if (c.phase == Phase::kStreaming) {
        c.out += http_chunk(out.body);
        if (done) c.out += kLastChunk;
      } else if (done) {
        // The handler's headers (CORS) go with the response it deferred.
        out.headers.insert(out.headers.end(), c.response.headers.begin(), c.response.headers.end());
        queue_whole(c, out, c.request.keep_alive);
      }
    } catch (const std::exception& e) {
      // Nothing sensible can follow a broken stream; a whole response is not sent yet, so it can be an error.
      fmt::print(stderr, "fulcrum serve: response failed: {}\n", e.what());
      body->cancel(false);
      if (c.phase == Phase::kStreaming) {
        c.close_after = true;
      } else {
        out = internal_error("the response failed; see the server log");
        queue_whole(c, out, false);
      }
      done = true;
    }
    if (!done) return false;
    answered(c, c.request, c.phase == Phase::kStreaming ? c.response.status : out.status, body->tokens(), false);
    if (c.phase == Phase::kStreaming && !c.request.keep_alive) c.close_after = true;
    c.response = HttpResponse{};
    c.phase = Phase::kReading;
    c.last_activity = c.request_begin = Clock::now();
    return true;
  }

  // Parses and answers what the buffered bytes hold, in order; polls the deferred response first when `poll`.
  // False when the connection was closed.
  bool advance(Connection& c, bool poll) {
    for (;;) {
      if (c.phase == Phase::kDeferred || c.phase == Phase::kStreaming) {
        if (!poll || !poll_deferred(c)) break;
      }
      if (c.phase != Phase::kReading || c.close_after || c.out.size() - c.out_pos >= kMaxPendingOutput) break;
      if (c.parser.state() == RequestParser::State::kNeedMore && c.in_pos < c.in.size()) {
        c.in_pos += c.parser.feed(c.in.data() + c.in_pos, c.in.size() - c.in_pos);
        if (c.parser.take_continue_due()) c.out += "HTTP/1.1 100 Continue\r\n\r\n";
        if (c.in_pos == c.in.size()) {
          c.in.clear();
          c.in_pos = 0;
        }
      }
      if (c.parser.state() == RequestParser::State::kError) {
        answer_error(c, c.parser.error_status(), c.parser.error_message());
        break;
      }
      if (c.parser.state() == RequestParser::State::kNeedMore) {
        if (c.peer_closed) c.close_after = true;  // the client sent all it will: answer nothing more
        break;
      }
      dispatch(c);
      poll = true;  // a deferred response may be ready at once
    }
    return flush(c);
  }

  void dispatch(Connection& c) {
    c.request = c.parser.take();
    c.answer_begin = Clock::now();
    c.timed_out = false;
    HttpResponse r;
    try {
      r = handler(c.request, wake_for(c.id));
    } catch (const std::exception& e) {
      fmt::print(stderr, "fulcrum serve: handler failed: {}\n", e.what());
      r = internal_error("the handler failed; see the server log");
      r.rejected = true;
    }
    if (!r.deferred) {
      queue_whole(c, r, c.request.keep_alive);
      answered(c, c.request, r.status, 0, r.rejected);
      c.last_activity = c.request_begin = Clock::now();
      return;
    }
    if (r.stream) {
      c.out += http_response_head(r.status, r.headers, -1, c.request.keep_alive);
      c.phase = Phase::kStreaming;
    } else {
      c.phase = Phase::kDeferred;
    }
    r.body.clear();
    c.response = std::move(r);
  }

  bool read_some(Connection& c) {
    char buffer[kReadChunk];
    for (int i = 0; i < kReadsPerEvent; ++i) {
      const ssize_t n = ::recv(c.fd, buffer, sizeof buffer, 0);
      if (n > 0) {
        const auto now = Clock::now();
        if (c.phase == Phase::kLingering) {
          c.lingered += static_cast<size_t>(n);
          if (c.lingered > kLingerBytes) {
            close_connection(c);
            return false;
          }
          continue;
        }
        if (c.phase == Phase::kReading && c.in_pos == c.in.size() && !c.parser.started()) c.request_begin = now;
        c.last_activity = now;
        c.in.append(buffer, static_cast<size_t>(n));
        if (c.phase != Phase::kReading && c.in.size() - c.in_pos >= kMaxBufferedInput) break;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (n == 0 && c.phase == Phase::kLingering) {
        close_connection(c);
        return false;
      }
      if (n < 0 || c.phase != Phase::kReading) {
        close_connection(c);  // reset, or gone while its response was in progress (cancelled)
        return false;
      }
      c.peer_closed = true;  // half-closed: what it sent is still answered
      return true;
    }
    return true;
  }

  void on_connection_event(Connection& c, uint32_t events) {
    if ((events & (EPOLLERR | EPOLLHUP)) != 0 && (events & EPOLLIN) == 0) {
      close_connection(c);
      return;
    }
    if ((events & (EPOLLIN | EPOLLRDHUP)) != 0) {
      if ((c.events & EPOLLIN) == 0 && c.phase != Phase::kReading && c.phase != Phase::kLingering) {
        close_connection(c);  // the peer closed while reading was paused under a response in progress
        return;
      }
      if (!read_some(c)) return;
      if (c.phase == Phase::kLingering) return;
    }
    advance(c, false);
  }

  void accept_all() {
    for (;;) {
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors: stop accepting for a moment rather than spin (the backlog holds the clients).
          pause_accept();
        }
        return;
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // SSE tokens leave at once
      const bool refused = num_counted >= options.max_connections;
      if (refused && num_refused >= kMaxRefusedLingering) {
        ::close(fd);
        continue;
      }
      const uint64_t id = next_id++;
      auto owned = std::make_unique<Connection>(fd, id, options.limits, Clock::now());
      Connection& c = *owned;
      conns.emplace(id, std::move(owned));
      (refused ? num_refused : num_counted) += 1;
      ++num_open;
      c.refused = refused;
      epoll_event ev{};
      ev.events = c.events = EPOLLIN | EPOLLRDHUP;
      ev.data.u64 = id;
      ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev);
      if (refused) {
        answer_error(c, 503, fmt::format("too many connections (--max-connections {})", options.max_connections));
        flush(c);
      }
    }
  }

  void pause_accept() {
    epoll_event ev{};
    ev.data.u64 = kListenerId;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, listen_fd, &ev);
    accept_paused = true;
    accept_resume = Clock::now() + std::chrono::milliseconds(100);
  }

  void drain_wakes() {
    uint64_t count = 0;
    [[maybe_unused]] const ssize_t n = ::read(wakes->event_fd, &count, sizeof count);
    std::vector<uint64_t> ids;
    {
      std::lock_guard lock(wakes->mutex);
      ids.swap(wakes->ids);
    }
    for (const uint64_t id : ids) {
      const auto it = conns.find(id);
      if (it != conns.end() && (it->second->phase == Phase::kDeferred || it->second->phase == Phase::kStreaming)) {
        advance(*it->second, true);
      }
    }
  }

  // Deadlines: header read, idle keep-alive, request timeout, lingering; deferred bodies polled once a second.
  void scan() {
    const auto now = Clock::now();
    if (accept_paused && now >= accept_resume) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = kListenerId;
      ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, listen_fd, &ev);
      accept_paused = false;
    }
    std::vector<uint64_t> ids;
    ids.reserve(conns.size());
    for (const auto& [id, c] : conns) ids.push_back(id);
    for (const uint64_t id : ids) {
      const auto it = conns.find(id);
      if (it == conns.end()) continue;
      Connection& c = *it->second;
      switch (c.phase) {
        case Phase::kLingering:
          if (now >= c.linger_until) close_connection(c);
          break;
        case Phase::kReading: {
          if (c.close_after) break;
          const bool in_headers = (c.parser.started() || c.in_pos < c.in.size()) && !c.parser.headers_done();
          if (in_headers && seconds_between(c.request_begin, now) > options.header_timeout_s) {
            answer_error(c, 408, fmt::format("the request headers took longer than {} s", options.header_timeout_s));
            flush(c);
          } else if (!in_headers && c.out_pos == c.out.size() &&
                     seconds_between(c.last_activity, now) > options.idle_timeout_s) {
            close_connection(c);
          }
          break;
        }
        case Phase::kDeferred:
        case Phase::kStreaming:
          if (options.request_timeout_s > 0 && !c.timed_out &&
              seconds_between(c.answer_begin, now) > options.request_timeout_s) {
            c.timed_out = true;
            c.response.deferred->cancel(true);
            advance(c, true);
          } else if (now - c.last_poll >= kPollInterval) {
            advance(c, true);
          }
          break;
      }
    }
  }

  void close_all() {
    std::vector<uint64_t> ids;
    for (const auto& [id, c] : conns) ids.push_back(id);
    for (const uint64_t id : ids) close_connection(*conns.at(id));
    if (listen_fd >= 0) ::close(listen_fd);
    listen_fd = -1;
  }
};

HttpTransport::HttpTransport(HttpTransportOptions options, HttpHandler handler,
                             std::function<void(const HttpExchange&)> on_answered)
    : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->handler = std::move(handler);
  impl_->on_answered = std::move(on_answered);
  impl_->epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  FULCRUM_CHECK(impl_->epoll_fd >= 0 && impl_->wakes->event_fd >= 0, "cannot create the HTTP event loop: {}",
                std::strerror(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeId;
  ::epoll_ctl(impl_->epoll_fd, EPOLL_CTL_ADD, impl_->wakes->event_fd, &ev);
}

HttpTransport::~HttpTransport() {
  impl_->close_all();
  ::close(impl_->epoll_fd);
}

int HttpTransport::bind(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  FULCRUM_CHECK(::getaddrinfo(host.c_str(), service.c_str(), &hints, &found) == 0 && found,
                "cannot listen on {}:{}: the host is not an address of this machine", host, port);
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, ::freeaddrinfo);
  const int fd = ::socket(found->ai_family, found->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, found->ai_protocol);
  FULCRUM_CHECK(fd >= 0, "cannot create a socket for {}:{}: {}", host, port, std::strerror(errno));
  // SO_REUSEADDR only (a restart may bind while old connections sit in TIME_WAIT); never SO_REUSEPORT, with
  // which a second server on the same port would start and the kernel would split connections between them.
  const int yes = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  if (::bind(fd, found->ai_addr, found->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    const int err = errno;
    ::close(fd);
    FULCRUM_CHECK(false, "cannot listen on {}:{}: {}", host, port,
                  err == EADDRINUSE ? "the port is in use" : std::strerror(err));
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int bound = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6&>(addr).sin6_port)
                                               : ntohs(reinterpret_cast<sockaddr_in&>(addr).sin_port);
  impl_->listen_fd = fd;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kListenerId;
  ::epoll_ctl(impl_->epoll_fd, EPOLL_CTL_ADD, fd, &ev);
  return bound;
}

void HttpTransport::run() {
  Impl& s = *impl_;
  epoll_event events[256];
  auto next_scan = Clock::now() + kScanInterval;
  while (!s.stopping) {
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_scan - Clock::now()).count();
    const int n = ::epoll_wait(s.epoll_fd, events, 256, static_cast<int>(std::max<int64_t>(0, wait) + 1));
    FULCRUM_CHECK(n >= 0 || errno == EINTR, "epoll_wait failed: {}", std::strerror(errno));
    for (int i = 0; i < n && !s.stopping; ++i) {
      const uint64_t id = events[i].data.u64;
      if (id == kListenerId) {
        s.accept_all();
      } else if (id == kWakeId) {
        s.drain_wakes();
      } else if (const auto it = s.conns.find(id); it != s.conns.end()) {
        s.on_connection_event(*it->second, events[i].events);
      }
    }
    if (Clock::now() >= next_scan) {
      s.scan();
      next_scan = Clock::now() + kScanInterval;
    }
  }
  s.close_all();
}

void HttpTransport::stop() {
  impl_->stopping = true;
  impl_->wakes->signal();
}

int HttpTransport::responses_in_progress() const { return impl_->num_busy.load(); }
int HttpTransport::open_connections() const { return impl_->num_open.load(); }

}  // namespace fulcrum::server
