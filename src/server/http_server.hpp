#pragma once
// Fulcrum's HTTP API over the event-driven transport (http_transport.hpp): OpenAI-compatible /v1/completions,
// /v1/chat/completions (JSON or SSE streaming, token by token), /v1/models, /health, SGLang's native /generate,
// /get_model_info, /get_server_info (and /server_info), /flush_cache, /metrics (Prometheus) and the
// expert-distribution endpoints; with an API key, Bearer auth; with a CORS origin, CORS headers and preflights.
// Every refusal is a 4xx/5xx with {"error": {"message", "type"}}, counted by reason in
// fulcrum_requests_rejected_total. A client that goes away (its socket closed or reset) has its request
// cancelled, which frees its KV pages; so has one past the request timeout (504, or an SSE error event).
#include <memory>
#include <string>

#include "server/expert_distribution.hpp"
#include "server/http_transport.hpp"
#include "server/metrics.hpp"
#include "server/protocol.hpp"
#include "server/scheduler.hpp"

namespace fulcrum::server {

struct HttpServerOptions {
  ProtocolContext protocol;
  int64_t max_model_len = 0;
  int vocab_size = 0;
  std::string expert_distribution_dir = ".";  // where /dump_expert_distribution_record writes
  HttpTransportOptions transport;  // limits, timeouts, --max-connections
  int max_queued_requests = 1024;  // generation requests waiting for admission; beyond: 429 with Retry-After
  std::string api_key;             // non-empty: routes other than /health and /metrics need "Bearer KEY"
  std::string cors_allow_origin;   // non-empty: Access-Control-Allow-Origin on every answer; OPTIONS preflights
  bool access_log = false;         // one stderr line per answered request
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

  // Binds `host`:`port` exclusively (0: any free port) and returns the port; throws when it cannot.
  int bind(const std::string& host, int port);
  // Serves until stop(); every connection is closed when it returns.
  void listen();
  // From any thread, also before listen() has begun (listen() then returns at once). Responses still in
  // progress are cut short (their requests cancelled), so call wait_responses_sent() first.
  void stop();
  // Waits until every response begun has been written to the end (or its client went away), at most
  // `seconds`; false on timeout.
  bool wait_responses_sent(double seconds);
  // While draining, /health answers 503 (new requests are refused by the scheduler).
  void set_draining();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fulcrum::server
