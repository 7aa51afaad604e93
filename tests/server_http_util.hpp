#pragma once
// Real HTTP clients of the server tests (cpp-httplib): SSE streaming and JSON posts, and /metrics parsed
// as Prometheus text. Include only from files compiled with cpp-httplib's flags (tests/CMakeLists.txt).
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

namespace fulcrum::test {

using nlohmann::json;

struct Streamed {
  int status = 0;
  std::vector<json> events;
  bool done = false;
  std::string body;  // non-200 bodies
};

inline Streamed stream_post(int port, const std::string& path, const json& body) {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(60);
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  Streamed out;
  std::string buffer;
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    buffer.append(data, size);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos; buffer.erase(0, end + 2)) {
      const std::string event = buffer.substr(0, end);
      if (event == "data: [DONE]") out.done = true;
      else if (event.starts_with("data: ")) out.events.push_back(json::parse(event.substr(6)));
    }
    return true;
  };
  const httplib::Result res = client.send(req);
  if (res) out.status = res->status;
  if (res && res->status != 200) out.body = res->body;
  return out;
}

inline std::pair<int, json> post(int port, const std::string& path, const std::string& body) {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(60);
  const httplib::Result res = client.Post(path.c_str(), body, "application/json");
  if (!res) return {0, json()};
  return {res->status, json::parse(res->body, nullptr, false)};
}

// Prometheus text: every sample line is `name{labels} value`; returns samples by "name{labels}".
inline std::map<std::string, double> parse_prometheus(const std::string& text) {
  std::map<std::string, double> samples;
  const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*\})?) (\S+)$)");
  const std::regex meta(R"(^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+$)");
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("#")) {
      EXPECT_TRUE(std::regex_match(line, meta)) << line;
      continue;
    }
    std::smatch m;
    EXPECT_TRUE(std::regex_match(line, m, sample)) << line;
    if (m.size() > 4) samples[m[1]] = std::strtod(m[4].str().c_str(), nullptr);
  }
  return samples;
}

inline std::map<std::string, double> metrics(int port) {
  httplib::Client client("127.0.0.1", port);
  const httplib::Result res = client.Get("/metrics");
  EXPECT_TRUE(res && res->status == 200);
  return res ? parse_prometheus(res->body) : std::map<std::string, double>{};
}

}  // namespace fulcrum::test
