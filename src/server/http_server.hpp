#pragma once
// The HTTP front end (cpp-httplib): OpenAI-compatible /v1/completions, /v1/chat/completions (JSON or
// SSE streaming), /v1/models, /health, SGLang's native /generate, /get_model_info, /get_server_info (and
// /server_info), /metrics (Prometheus) and the expert-distribution endpoints; with an API key, Bearer auth. Every refusal is a 4xx/5xx with {"error": {"message", "type"}}.
// A streaming client that goes away is noticed at the next write (tokens or a keep-alive comment every
// second), a non-streaming one within 100 ms by polling its socket (ConnectionWatch); either way its
// request is cancelled, which frees its KV pages.
#include <memory>
#include <string>

#include "server/expert_distribution.hpp"
#include "server/metrics.hpp"
#include "server/protocol.hpp"
#include "server/scheduler.hpp"

namespace fulcrum::server {

struct HttpServerOptions {
  ProtocolContext protocol;
  int64_t max_model_len = 0;
  int vocab_size = 0;
  std::string expert_distribution_dir = ".";  // where /dump_expert_distribution_record writes
  int threads = 64;                           // concurrent connections served
  size_t max_body_bytes = size_t{8} << 20;
  std::string api_key;             // non-empty: routes other than /health and /metrics need "Bearer KEY"
  std::string model_path;          // /get_model_info's model_path (the --model folder)
  nlohmann::json server_info;      // /get_server_info: the launch settings (serve.cpp)
};

class HttpServer {
 public:
  // `recorder` may be null (the endpoints then answer 501).
  HttpServer(Scheduler& scheduler, ServerMetrics& metrics, ExpertDistributionRecorder* recorder,
             HttpServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds `host`:`port` (0: any free port) and returns the port; throws when it cannot.
  int bind(const std::string& host, int port);
  // Serves until stop(); returns after in-flight handlers finished.
  void listen();
  // Closes the listener; from any thread, also before listen() has begun (listen() then returns at once). A
  // stream still being written is cut short by cpp-httplib once it stops, so call wait_streams_sent() first.
  void stop();
  // Waits until every streamed response has been written to the end (or its client went away), at most
  // `seconds`; false on timeout.
  bool wait_streams_sent(double seconds);
  // While draining, /health answers 503 (new requests are refused by the scheduler).
  void set_draining();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fulcrum::server
