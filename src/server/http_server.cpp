#include "server/http_server.hpp"

#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <thread>

#include <fmt/format.h>

#include "eplb/json_text.hpp"
#include "server/api_error.hpp"
#include "server/responses.hpp"

namespace fulcrum::server {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

HttpResponse json_response(int status, const json& body) {
  HttpResponse r;
  r.status = status;
  r.headers = {{"Content-Type", "application/json"}};
  if (status == 429 || status == 503) r.headers.emplace_back("Retry-After", "1");
  r.body = body.dump() + "\n";
  return r;
}

HttpResponse refusal(int status, const std::string& message, const std::string& type) {
  HttpResponse r = json_response(status, error_body(message, type));
  r.rejected = true;
  return r;
}

// NOTES: a dump name is one plain file name in --expert-distribution-dir: 1 to 240 bytes (the file is written
// through ".NAME.tmp.PID", 13 bytes longer, which must fit NAME_MAX = 255), no NUL (the OS would cut the name
// there), no '/', not "." or "..". Anything else is a 400 that quotes none of it.
constexpr size_t kMaxDumpNameBytes = 240;
void check_dump_name(const std::string& name) {
  FULCRUM_REQUIRE(!name.empty() && name.size() <= kMaxDumpNameBytes,
                  "'name' must be 1 to {} bytes, got {}", kMaxDumpNameBytes, name.size());
  FULCRUM_REQUIRE(name.find('\0') == std::string::npos, "'name' must not contain a NUL character");
  FULCRUM_REQUIRE(name.find('/') == std::string::npos && name != "." && name != "..",
                  "'name' must be a plain file name (no '/', not '.' or '..')");
}

// The rest of a generation response: the choices' ResponseWriters, polled by the transport whenever a
// handle made progress (RequestHandle::set_on_progress) and at least once a second.
class GenerationBody : public DeferredBody {
 public:
  GenerationBody(Endpoint endpoint, std::vector<std::shared_ptr<ResponseWriter>> writers, const ParsedRequest& parsed,
                 double request_timeout_s)
      : endpoint_(endpoint), writers_(std::move(writers)), n_(parsed.n), batched_(parsed.batched),
        stream_(parsed.stream), request_timeout_s_(request_timeout_s) {}

  bool poll(HttpResponse& response) override {
    if (timed_out_) {
      const std::string message = fmt::format("the request took longer than --request-timeout {} s", request_timeout_s_);
      if (!stream_) {
        response = json_response(504, error_body(message, "timeout"));
      } else {
        response.body = "data: " + error_body(message, "timeout").dump() + "\n\ndata: [DONE]\n\n";
      }
      return true;
    }
    if (stream_) {
      ResponseWriter& writer = *writers_.at(0);  // streaming: one choice (protocol.cpp)
      std::string events = writer.next_events(std::chrono::milliseconds(0));
      const auto now = Clock::now();
      // A comment after a second of silence: proxies keep the stream open, and a gone client is found out.
      if (events.empty() && now - last_sent_ >= std::chrono::seconds(1)) events = ": keep-alive\n\n";
      if (!events.empty()) last_sent_ = now;
      response.body = std::move(events);
      return writer.done();
    }
    for (const auto& w : writers_) {
      if (w->handle().finish_reason() == FinishReason::kNone) return false;
    }
    std::vector<json> bodies;
    bool failed = false;
    for (const auto& w : writers_) {
      bodies.push_back(w->complete());  // finished: does not block
      failed = failed || w->handle().finish_reason() == FinishReason::kError;
    }
    response = failed ? json_response(500, error_body("the model step failed; see the server log", "internal_error"))
                      : json_response(200, merge_choices(endpoint_, std::move(bodies), n_, batched_));
    return true;
  }

  void cancel(bool timed_out) override {
    timed_out_ = timed_out_ || timed_out;
    for (const auto& w : writers_) w->handle().cancel();  // its KV pages free at the scheduler's next step
  }

  int64_t tokens() const override {
    int64_t total = 0;
    for (const auto& w : writers_) total += w->num_tokens();
    return total;
  }

 private:
  const Endpoint endpoint_;
  const std::vector<std::shared_ptr<ResponseWriter>> writers_;
  const int n_;
  const bool batched_;
  const bool stream_;
  const double request_timeout_s_;
  bool timed_out_ = false;
  Clock::time_point last_sent_ = Clock::now();
};

// fulcrum_requests_rejected_total's reason label of a refusal's status.
const char* rejection_reason(int status) {
  switch (status) {
    case 400: return "bad_request";
    case 401: return "unauthorized";
    case 404: return "not_found";
    case 408: return "header_timeout";
    case 413: return "body_too_large";
    case 429: return "queue_full";
    case 431: return "headers_too_large";
    case 501: return "not_implemented";
    case 503: return "unavailable";
    default: return status >= 500 ? "internal_error" : "other";
  }
}

}  // namespace

struct HttpServer::Impl {
  using Route = std::function<HttpResponse(const HttpRequest&, const HttpWake&)>;
  struct RouteEntry {
    bool get = false, post = false;
    Route route;
  };

  Scheduler& scheduler;
  ServerMetrics& metrics;
  ExpertDistributionRecorder* recorder;
  HttpServerOptions options;
  std::map<std::string, RouteEntry, std::less<>> routes;
  HttpTransport transport;
  std::atomic<bool> draining{false};

  Impl(Scheduler& s, ServerMetrics& m, ExpertDistributionRecorder* r, HttpServerOptions o)
      : scheduler(s), metrics(m), recorder(r), options(std::move(o)),
        transport(options.transport, [this](const HttpRequest& req, const HttpWake& wake) { return handle(req, wake); },
                  [this](const HttpExchange& e) { answered(e); }) {
    add_routes();
  }

  HttpResponse handle(const HttpRequest& req, const HttpWake& wake) {
    HttpResponse r = route(req, wake);
    if (!options.cors_allow_origin.empty()) r.headers.emplace_back("Access-Control-Allow-Origin", options.cors_allow_origin);
    return r;
  }

  HttpResponse route(const HttpRequest& req, const HttpWake& wake) {
    if (req.method == "OPTIONS" && !options.cors_allow_origin.empty()) {  // a CORS preflight
      HttpResponse r;
      r.status = 204;
      r.headers = {{"Access-Control-Allow-Methods", "GET, POST, OPTIONS"},
                   {"Access-Control-Allow-Headers", "Authorization, Content-Type"},
                   {"Access-Control-Max-Age", "86400"}};
      return r;
    }
    const auto it = routes.find(req.path);
    if (it == routes.end() || !((req.method == "GET" && it->second.get) || (req.method == "POST" && it->second.post))) {
      return refusal(404,
                     fmt::format("no route for {} {}", eplb::printable_excerpt(req.method),
                                 eplb::printable_excerpt(req.path)),
                     "not_found");
    }
    // --api-key: every route but /health and /metrics wants "Authorization: Bearer KEY".
    if (!options.api_key.empty() && req.path != "/health" && req.path != "/metrics" &&
        req.header("authorization") != "Bearer " + options.api_key) {
      return refusal(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", "authentication_error");
    }
    try {
      return it->second.route(req, wake);
    } catch (const ApiError& e) {
      return refusal(e.status(), e.what(), e.type());
    } catch (const std::exception& e) {
      return refusal(500, e.what(), "internal_error");
    }
  }

  void answered(const HttpExchange& e) {
    if (e.rejected) metrics.on_request_rejected(rejection_reason(e.status));
    if (!options.access_log) return;
    fmt::print(stderr, "fulcrum serve: access: {} {} {} {:.1f}ms tokens={}\n", eplb::printable_excerpt(e.request.method, 16),
               e.request.method.empty() ? "-" : eplb::printable_excerpt(e.request.target, 200), e.status, e.seconds * 1e3,
               e.tokens);
  }

  HttpResponse generation(Endpoint endpoint, const HttpRequest& req, const HttpWake& wake) {
    const json body = parse_json_body(req.body);
    const ProtocolContext& ctx = options.protocol;
    ParsedRequest parsed = endpoint == Endpoint::kCompletion ? parse_completion_request(body, ctx)
                           : endpoint == Endpoint::kChat     ? parse_chat_request(body, ctx)
                                                             : parse_generate_request(body, ctx);
    const int64_t waiting = scheduler.gauges().waiting;
    if (waiting + static_cast<int64_t>(parsed.requests.size()) > options.max_queued_requests) {
      throw ApiError(429, "rate_limit_exceeded",
                     fmt::format("{} requests are queued (--max-queued-requests {}); retry later", waiting,
                                 options.max_queued_requests));
    }
    // Every choice is its own request; one refused choice cancels the ones already submitted.
    std::vector<std::shared_ptr<ResponseWriter>> writers;
    try {
      for (RequestParams& params : parsed.requests) {
        std::vector<std::string> stop = params.stop;
        std::vector<int32_t> prompt = parsed.format.logprobs || parsed.format.echo ? params.prompt : std::vector<int32_t>();
        std::shared_ptr<RequestHandle> handle = scheduler.submit(std::move(params));
        handle->set_on_progress(wake);
        writers.push_back(std::make_shared<ResponseWriter>(endpoint, handle, ctx.tokenizer, std::move(stop),
                                                           ctx.model_name, parsed.include_usage, parsed.prefill_only,
                                                           parsed.format, std::move(prompt)));
      }
    } catch (...) {
      for (const auto& w : writers) w->handle().cancel();
      throw;
    }
    HttpResponse r;
    r.deferred = std::make_shared<GenerationBody>(endpoint, std::move(writers), parsed, options.transport.request_timeout_s);
    if (parsed.stream) {
      r.stream = true;
      r.headers = {{"Content-Type", "text/event-stream"}, {"Cache-Control", "no-cache"}};
    }
    return r;
  }

  HttpResponse expert_distribution(const std::string& action, const HttpRequest& req) {
    if (!recorder) throw ApiError(501, "not_implemented", "this executor records no expert distribution");
    if (action == "start") {
      recorder->start();
      return json_response(200, {{"status", "recording"}});
    }
    if (action == "stop") {
      recorder->stop();
      return json_response(200, {{"status", "stopped"}});
    }
    std::string name = fmt::format("expert_distribution_{}.json",
                                   std::chrono::duration_cast<std::chrono::milliseconds>(
                                       std::chrono::system_clock::now().time_since_epoch()).count());
    if (!req.body.empty()) {
      const json body = parse_json_body(req.body);
      for (const auto& [key, value] : body.items()) FULCRUM_REQUIRE(key == "name", "unknown field '{}'", key);
      if (body.contains("name")) {
        FULCRUM_REQUIRE(body["name"].is_string(), "'name' must be a string");
        name = body["name"].get<std::string>();
        check_dump_name(name);
      }
    }
    const std::string path = (std::filesystem::absolute(options.expert_distribution_dir) / name).string();
    json out;
    try {
      out = recorder->dump(path);
    } catch (const std::exception& e) {
      // The full reason (with the server's path) goes to the log only.
      fmt::print(stderr, "fulcrum serve: expert distribution dump failed: {}\n", e.what());
      throw ApiError(500, "internal_error", "the expert distribution could not be written; see the server log");
    }
    out["path"] = path;
    return json_response(200, out);
  }

  // SGLang's /get_model_info and /get_server_info as its RuntimeEndpoint reads them.
  json model_info() const {
    return {{"model_path", options.model_path},
            {"tokenizer_path", options.protocol.tokenizer ? json(options.model_path) : json(nullptr)},
            {"is_generation", true},
            {"served_model_name", options.protocol.model_name},
            {"max_model_len", options.max_model_len},
            {"vocab_size", options.vocab_size}};
  }
  json server_info() const {
    json info = options.server_info;
    info["model_path"] = options.model_path;
    info["served_model_name"] = options.protocol.model_name;
    info["context_length"] = options.max_model_len;
    info["version"] = "fulcrum";
    return info;
  }

  void add(const std::string& path, bool get, bool post, Route route) { routes[path] = {get, post, std::move(route)}; }
  // A route whose answer is ready at once (no wake needed).
  template <typename F>
  void add_now(const std::string& path, bool get, bool post, F f) {
    add(path, get, post, [f](const HttpRequest& req, const HttpWake&) { return f(req); });
  }

  void add_routes() {
    add_now("/get_model_info", true, false, [this](const HttpRequest&) { return json_response(200, model_info()); });
    for (const char* path : {"/get_server_info", "/server_info"}) {
      add_now(path, true, false, [this](const HttpRequest&) { return json_response(200, server_info()); });
    }
    add_now("/health", true, false, [this](const HttpRequest&) {
      if (draining) throw ApiError(503, "unavailable", "shutting down");
      return json_response(200, {{"status", "ok"}});
    });
    add_now("/v1/models", true, false, [this](const HttpRequest&) {
      return json_response(200, {{"object", "list"},
                                 {"data", json::array({{{"id", options.protocol.model_name}, {"object", "model"},
                                                        {"owned_by", "fulcrum"}, {"max_model_len", options.max_model_len},
                                                        {"vocab_size", options.vocab_size},
                                                        {"has_tokenizer", options.protocol.tokenizer != nullptr}}})}});
    });
    add_now("/metrics", true, false, [this](const HttpRequest&) {
      HttpResponse r;
      r.headers = {{"Content-Type", "text/plain; version=0.0.4"}};
      r.body = metrics.render(scheduler.gauges());
      return r;
    });
    const std::pair<const char*, Endpoint> generation_routes[] = {
        {"/v1/completions", Endpoint::kCompletion}, {"/v1/chat/completions", Endpoint::kChat},
        {"/generate", Endpoint::kGenerate}};
    for (const auto& [path, endpoint] : generation_routes) {
      add(path, false, true, [this, endpoint = endpoint](const HttpRequest& req, const HttpWake& wake) {
        return generation(endpoint, req, wake);
      });
    }
    for (const char* action : {"start", "stop", "dump"}) {
      add_now(fmt::format("/{}_expert_distribution_record", action), true, true,
              [this, action = std::string(action)](const HttpRequest& req) { return expert_distribution(action, req); });
    }
    // SGLang's endpoint: empties the prefix cache (pages running requests hold stay until they end).
    add_now("/flush_cache", true, true, [this](const HttpRequest&) {
      const FlushResult r = scheduler.flush_cache();
      return json_response(200, {{"flushed_pages", r.flushed_pages}, {"in_use_pages", r.in_use_pages}});
    });
  }
};

HttpServer::HttpServer(Scheduler& scheduler, ServerMetrics& metrics, ExpertDistributionRecorder* recorder,
                       HttpServerOptions options)
    : impl_(std::make_unique<Impl>(scheduler, metrics, recorder, std::move(options))) {}

HttpServer::~HttpServer() = default;

int HttpServer::bind(const std::string& host, int port) { return impl_->transport.bind(host, port); }
void HttpServer::listen() { impl_->transport.run(); }
void HttpServer::stop() { impl_->transport.stop(); }

bool HttpServer::wait_responses_sent(double seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (impl_->transport.responses_in_progress() > 0) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}
void HttpServer::set_draining() { impl_->draining = true; }

}  // namespace fulcrum::server
