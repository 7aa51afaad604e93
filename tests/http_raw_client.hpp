#pragma once
// A raw HTTP/1.1 client over blocking loopback sockets, for tests that must misbehave the way no HTTP library
// lets them (pipelining, dripping headers, endless chunked bodies): connect, send bytes, read responses
// (Content-Length or chunked) with a deadline.
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <string>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

namespace fulcrum::test {

// -1 when the connection is refused.
inline int connect_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

// False when the peer closed or reset.
inline bool send_all(int fd, const std::string& data) {
  for (size_t sent = 0; sent < data.size();) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

// Reads what arrives within `timeout_s` into `buffer`; false on EOF, reset or timeout.
inline bool read_more(int fd, std::string& buffer, double timeout_s) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout_s * 1000)) <= 0) return false;
  char chunk[65536];
  const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
  if (n <= 0) return false;
  buffer.append(chunk, static_cast<size_t>(n));
  return true;
}

struct RawResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;                            // chunked bodies joined
  std::string header(const std::string& name) const {  // "" when absent
    const auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
};

// One response off `buffer` (reading more from `fd` as needed); what follows it stays in `buffer`.
inline std::optional<RawResponse> read_response(int fd, std::string& buffer, double timeout_s = 30) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  const auto left = [&] { return std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count(); };
  size_t head_end;
  while ((head_end = buffer.find("\r\n\r\n")) == std::string::npos) {
    if (left() <= 0 || !read_more(fd, buffer, left())) return std::nullopt;
  }
  RawResponse r;
  const std::string head = buffer.substr(0, head_end);
  buffer.erase(0, head_end + 4);
  if (std::sscanf(head.c_str(), "HTTP/1.%*d %d", &r.status) != 1) return std::nullopt;
  for (size_t pos = head.find("\r\n"); pos != std::string::npos;) {
    const size_t next = head.find("\r\n", pos + 2);
    const std::string line = head.substr(pos + 2, next == std::string::npos ? std::string::npos : next - pos - 2);
    const size_t colon = line.find(':');
    if (colon != std::string::npos) {
      std::string name = line.substr(0, colon);
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      r.headers[name] = line.substr(line.find_first_not_of(' ', colon + 1));
    }
    pos = next;
  }
  if (r.status == 100) return read_response(fd, buffer, left());
  if (r.headers["transfer-encoding"] == "chunked") {
    for (;;) {
      size_t line_end;
      while ((line_end = buffer.find("\r\n")) == std::string::npos) {
        if (left() <= 0 || !read_more(fd, buffer, left())) return std::nullopt;
      }
      const size_t size = std::stoul(buffer.substr(0, line_end), nullptr, 16);
      while (buffer.size() < line_end + 2 + size + 2) {
        if (left() <= 0 || !read_more(fd, buffer, left())) return std::nullopt;
      }
      r.body += buffer.substr(line_end + 2, size);
      buffer.erase(0, line_end + 2 + size + 2);
      if (size == 0) return r;
    }
  }
  const size_t length = r.headers.count("content-length") ? std::stoul(r.headers["content-length"]) : 0;
  while (buffer.size() < length) {
    if (left() <= 0 || !read_more(fd, buffer, left())) return std::nullopt;
  }
  r.body = buffer.substr(0, length);
  buffer.erase(0, length);
  return r;
}

// One request on a fresh loopback connection ("Connection: close"); the response, or nothing on a connect, send or
// read failure. A body goes as JSON.
inline std::optional<RawResponse> raw_request(int port, const std::string& method, const std::string& path,
                                              const std::string& body = "", double timeout_s = 120) {
  const int fd = connect_loopback(port);
  if (fd < 0) return std::nullopt;
  std::string request = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  if (!body.empty()) {
    request += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  request += "\r\n" + body;
  std::optional<RawResponse> response;
  std::string buffer;
  if (send_all(fd, request)) response = read_response(fd, buffer, timeout_s);
  ::close(fd);
  return response;
}
inline std::optional<RawResponse> post_json(int port, const std::string& path, const std::string& body,
                                            double timeout_s = 120) {
  return raw_request(port, "POST", path, body, timeout_s);
}
inline std::optional<RawResponse> get_path(int port, const std::string& path, double timeout_s = 30) {
  return raw_request(port, "GET", path, "", timeout_s);
}

// Raises this process's open-file soft limit to the hard one; returns the soft limit now.
inline rlim_t raise_fd_limit() {
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = lim.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &lim);
  ::getrlimit(RLIMIT_NOFILE, &lim);
  return lim.rlim_cur;
}

}  // namespace fulcrum::test
