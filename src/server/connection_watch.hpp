#pragma once
// Whether the client of a non-streaming request is still there. cpp-httplib 0.11.4 (Debian's) gives a
// handler neither the connection's socket nor a "connection closed" query (later releases added
// Request::is_connection_closed), so the socket is found among this process's descriptors by its two
// ends (the request's local port and remote address:port) and polled for the peer's FIN or reset.
#include <string>

namespace fulcrum::server {

class ConnectionWatch {
 public:
  // Looks the socket up once; when none matches (e.g. not TCP), peer_closed() is always false.
  ConnectionWatch(const std::string& remote_addr, int remote_port, int local_port);

  // True once the peer has shut its side down or reset the connection. Valid while the request's
  // handler runs (the server closes the socket only after it returns).
  bool peer_closed() const;

 private:
  int fd_ = -1;
};

}  // namespace fulcrum::server
