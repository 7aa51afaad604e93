#pragma once
// Plain POSIX TCP sockets for the rendezvous and the host mesh between rank processes: an owning fd,
// listen / accept / connect with deadlines, and whole-buffer reads and writes. Failures throw
// fulcrum::Error with one line naming the address and the reason. Every connected socket detects a peer
// that vanished without FIN or RST (DeadPeerDetection below).
#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <utility>

namespace fulcrum::comm {

using Clock = std::chrono::steady_clock;

struct HostPort {
  std::string host;
  int port = 0;
  std::string str() const { return host + ":" + std::to_string(port); }
};

// "HOST:PORT" (HOST a name or IPv4 address); throws naming `flag` on anything else.
HostPort parse_host_port(const std::string& text, const std::string& flag);

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { close(); }

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void close();
  // Wakes a thread blocked in read on this socket (it then sees end of stream).
  void shutdown_both() const;

 private:
  int fd_ = -1;
};

// What every connected socket (accept_tcp, connect_tcp) sets so that a peer that vanished without FIN or RST
// (power loss, a pulled cable) fails reads and writes with ETIMEDOUT within about 50 s instead of blocking
// them forever: keepalive probes after `idle_s` quiet seconds, every `interval_s`, the connection dropped
// after `probes` unanswered ones; and TCP_USER_TIMEOUT, which drops it when sent data stays unacknowledged.
// NOTES: on Linux a set TCP_USER_TIMEOUT also replaces TCP_KEEPCNT as the keepalive limit, so it equals
// idle_s + interval_s * probes: both rules give up at the same time. A live peer's kernel answers probes
// and acknowledges data however busy its process is; only data it leaves unread for 50 s (a stopped
// process: its receive window stays closed) counts as unacknowledged. The mesh's reader threads always
// drain their sockets.
struct DeadPeerDetection {
  bool keepalive = false;    // SO_KEEPALIVE
  int idle_s = 0;            // TCP_KEEPIDLE
  int interval_s = 0;        // TCP_KEEPINTVL
  int probes = 0;            // TCP_KEEPCNT
  int user_timeout_ms = 0;   // TCP_USER_TIMEOUT
  bool operator==(const DeadPeerDetection&) const = default;
};
inline constexpr DeadPeerDetection kDeadPeerDetection{true, 20, 5, 6, 50'000};
static_assert(kDeadPeerDetection.user_timeout_ms ==
              1000 * (kDeadPeerDetection.idle_s + kDeadPeerDetection.interval_s * kDeadPeerDetection.probes));
// The options the kernel holds for `socket` (getsockopt).
DeadPeerDetection dead_peer_detection(const Socket& socket);

// Listens on every interface at `port` (0: the kernel picks one; local_port() says which).
Socket listen_tcp(int port, const std::string& what);
int local_port(const Socket& socket);
// The IPv4 address of the connected peer, as text.
std::string peer_address(const Socket& socket);
// An unused port at the time of the call (a single-host launch's rendezvous port), drawn at random below the
// kernel's ephemeral range so that no outgoing connection takes it before the rendezvous listens.
int pick_free_port();
// The kernel's ephemeral port range [low, high] (/proc/sys/net/ipv4/ip_local_port_range).
std::pair<int, int> ephemeral_port_range();

// Accepts one connection, or throws once `deadline` passes.
Socket accept_tcp(const Socket& listener, Clock::time_point deadline, const std::string& what);
// Connects, retrying while the peer is not listening yet, until `deadline`.
Socket connect_tcp(const HostPort& address, Clock::time_point deadline, const std::string& what);

void write_all(const Socket& socket, std::span<const std::byte> data, const std::string& what);
// Reads exactly data.size() bytes. Returns false on a clean end of stream before the first byte;
// throws on a partial message, an error, or the deadline (Clock::time_point::max(): wait forever).
bool read_all(const Socket& socket, std::span<std::byte> data, const std::string& what,
              Clock::time_point deadline = Clock::time_point::max());

}  // namespace fulcrum::comm
