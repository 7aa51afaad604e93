#pragma once
// Plain POSIX TCP sockets for the rendezvous and the host mesh between rank processes: an owning fd,
// listen / accept / connect with deadlines, and whole-buffer reads and writes. Failures throw
// fulcrum::Error with one line naming the address and the reason.
#include <chrono>
#include <cstddef>
#include <span>
#include <string>

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

// Listens on every interface at `port` (0: the kernel picks one; local_port() says which).
Socket listen_tcp(int port, const std::string& what);
int local_port(const Socket& socket);
// The IPv4 address of the connected peer, as text.
std::string peer_address(const Socket& socket);
// An unused port on 127.0.0.1 at the time of the call (a single-host launch's rendezvous port).
int pick_free_port();

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
