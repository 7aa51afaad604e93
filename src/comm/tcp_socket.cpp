#include "comm/tcp_socket.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <utility>
#include <thread>

#include "eplb/error.hpp"

namespace fulcrum::comm {
namespace {

std::string errno_text() { return std::strerror(errno); }

int millis_until(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return -1;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

// Waits until `fd` is ready for `events`; false once the deadline passes.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, millis_until(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) throw Error("poll failed: " + errno_text());
  }
}

void set_int_option(int fd, int level, int name, int value, const char* option, const std::string& what) {
  FULCRUM_CHECK(::setsockopt(fd, level, name, &value, sizeof(value)) == 0, "{}: cannot set {}: {}", what, option,
                errno_text());
}

int get_int_option(int fd, int level, int name, const char* option) {
  int value = 0;
  socklen_t len = sizeof(value);
  FULCRUM_CHECK(::getsockopt(fd, level, name, &value, &len) == 0, "cannot read {}: {}", option, errno_text());
  return value;
}

// Options of every connected socket: small control messages go out at once, dead peers are detected.
void configure_connection(int fd, const std::string& what) {
  const DeadPeerDetection& d = kDeadPeerDetection;
  set_int_option(fd, IPPROTO_TCP, TCP_NODELAY, 1, "TCP_NODELAY", what);
  set_int_option(fd, SOL_SOCKET, SO_KEEPALIVE, d.keepalive ? 1 : 0, "SO_KEEPALIVE", what);
  set_int_option(fd, IPPROTO_TCP, TCP_KEEPIDLE, d.idle_s, "TCP_KEEPIDLE", what);
  set_int_option(fd, IPPROTO_TCP, TCP_KEEPINTVL, d.interval_s, "TCP_KEEPINTVL", what);
  set_int_option(fd, IPPROTO_TCP, TCP_KEEPCNT, d.probes, "TCP_KEEPCNT", what);
  set_int_option(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, d.user_timeout_ms, "TCP_USER_TIMEOUT", what);
}

}  // namespace

HostPort parse_host_port(const std::string& text, const std::string& flag) {
  const size_t colon = text.rfind(':');
  FULCRUM_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < text.size(), "{}: expected HOST:PORT, got '{}'",
                flag, text);
  HostPort out{text.substr(0, colon), 0};
  const std::string port = text.substr(colon + 1);
  FULCRUM_CHECK(port.find_first_not_of("0123456789") == std::string::npos && port.size() <= 5,
                "{}: port '{}' is not a number", flag, port);
  out.port = std::stoi(port);
  FULCRUM_CHECK(out.port >= 1 && out.port <= 65535, "{}: port {} outside [1, 65535]", flag, out.port);
  return out;
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.release();
  }
  return *this;
}

int Socket::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Socket::shutdown_both() const {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

Socket listen_tcp(int port, const std::string& what) {
  Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  FULCRUM_CHECK(s.valid(), "{}: socket failed: {}", what, errno_text());
  const int one = 1;
  ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  FULCRUM_CHECK(::bind(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0, "{}: cannot listen on port {}: {}",
                what, port, errno_text());
  FULCRUM_CHECK(::listen(s.fd(), 128) == 0, "{}: listen failed: {}", what, errno_text());
  return s;
}

int local_port(const Socket& socket) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  FULCRUM_CHECK(::getsockname(socket.fd(), reinterpret_cast<sockaddr*>(&addr), &len) == 0, "getsockname failed: {}",
                errno_text());
  return ntohs(addr.sin_port);
}

std::string peer_address(const Socket& socket) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  FULCRUM_CHECK(::getpeername(socket.fd(), reinterpret_cast<sockaddr*>(&addr), &len) == 0, "getpeername failed: {}",
                errno_text());
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &addr.sin_addr, text, sizeof(text));
  return text;
}

DeadPeerDetection dead_peer_detection(const Socket& socket) {
  const int fd = socket.fd();
  return {get_int_option(fd, SOL_SOCKET, SO_KEEPALIVE, "SO_KEEPALIVE") != 0,
          get_int_option(fd, IPPROTO_TCP, TCP_KEEPIDLE, "TCP_KEEPIDLE"),
          get_int_option(fd, IPPROTO_TCP, TCP_KEEPINTVL, "TCP_KEEPINTVL"),
          get_int_option(fd, IPPROTO_TCP, TCP_KEEPCNT, "TCP_KEEPCNT"),
          get_int_option(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, "TCP_USER_TIMEOUT")};
}

std::pair<int, int> ephemeral_port_range() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0, high = 0;
  if (in >> low >> high && 1 <= low && low <= high && high <= 65535) return {low, high};
  return {32768, 60999};  // Linux's default
}

// bind(0) hands out a port from the ephemeral range, which the kernel also gives to outgoing connections: between
// this call and the rendezvous' listen, another process's connect could take it ("Address already in use", seen
// with tests in parallel). Ports below the range are only ever taken by an explicit bind, so draw one there.
int pick_free_port() {
  constexpr int kLowest = 10000;
  const int below = ephemeral_port_range().first;
  if (below - kLowest >= 1000) {
    std::mt19937 rng(std::random_device{}());
    std::uniform_int_distribution<int> port(kLowest, below - 1);
    for (int attempt = 0; attempt < 64; ++attempt) {
      const int candidate = port(rng);
      try {
        listen_tcp(candidate, "picking a free port");
        return candidate;
      } catch (const Error&) {
        // taken: draw again
      }
    }
  }
  return local_port(listen_tcp(0, "picking a free port"));
}

Socket accept_tcp(const Socket& listener, Clock::time_point deadline, const std::string& what) {
  while (true) {
    FULCRUM_CHECK(wait_for(listener.fd(), POLLIN, deadline), "{}: timed out waiting for a connection", what);
    Socket s(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC));
    if (s.valid()) {
      configure_connection(s.fd(), what);
      return s;
    }
    if (errno != EINTR && errno != ECONNABORTED && errno != EAGAIN) throw Error(what + ": accept failed: " + errno_text());
  }
}

Socket connect_tcp(const HostPort& address, Clock::time_point deadline, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(address.host.c_str(), std::to_string(address.port).c_str(), &hints, &found);
  FULCRUM_CHECK(rc == 0 && found != nullptr, "{}: cannot resolve '{}': {}", what, address.host, ::gai_strerror(rc));
  sockaddr_in target{};
  std::memcpy(&target, found->ai_addr, sizeof(target));
  ::freeaddrinfo(found);
  std::string last_error;
  while (true) {
    Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    FULCRUM_CHECK(s.valid(), "{}: socket failed: {}", what, errno_text());
    if (::connect(s.fd(), reinterpret_cast<sockaddr*>(&target), sizeof(target)) == 0) {
      configure_connection(s.fd(), what);
      return s;
    }
    last_error = errno_text();
    // Refused or unreachable: the peer may not be listening yet; retry until the deadline.
    FULCRUM_CHECK(Clock::now() < deadline, "{}: cannot connect to {}: {} (gave up after the timeout)", what,
                  address.str(), last_error);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void write_all(const Socket& socket, std::span<const std::byte> data, const std::string& what) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::send(socket.fd(), data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    FULCRUM_CHECK(n > 0, "{}: connection lost while sending: {}", what, n < 0 ? errno_text() : "closed");
    done += static_cast<size_t>(n);
  }
}

bool read_all(const Socket& socket, std::span<std::byte> data, const std::string& what, Clock::time_point deadline) {
  size_t done = 0;
  while (done < data.size()) {
    FULCRUM_CHECK(wait_for(socket.fd(), POLLIN, deadline), "{}: timed out waiting for data", what);
    const ssize_t n = ::recv(socket.fd(), data.data() + done, data.size() - done, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n == 0 && done == 0) return false;
    FULCRUM_CHECK(n > 0, "{}: connection lost while receiving: {}", what, n < 0 ? errno_text() : "closed mid-message");
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace fulcrum::comm
