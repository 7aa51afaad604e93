#include "server/http_server.hpp"

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>

#include <fmt/format.h>
#include <httplib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server/api_error.hpp"
#include "server/connection_watch.hpp"
#include "server/responses.hpp"

namespace fulcrum::server {
namespace {

using nlohmann::json;

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump() + "\n", "application/json");
}

// Client bytes for an error message: at most `max_bytes`, anything but printable ASCII as \xNN.
std::string printable_excerpt(std::string_view text, size_t max_bytes = 64) {
  std::string shown;
  for (size_t i = 0; i < text.size() && i < max_bytes; ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    shown += byte < 0x20 || byte >= 0x7f || byte == '\\' ? fmt::format("\\x{:02x}", byte) : std::string(1, text[i]);
  }
  if (text.size() > max_bytes) shown += "...";
  return shown;
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

}  // namespace

struct HttpServer::Impl {
  Scheduler& scheduler;
  ServerMetrics& metrics;
  ExpertDistributionRecorder* recorder;
  HttpServerOptions options;
  httplib::Server http;
  std::atomic<bool> draining{false};
  std::atomic<int> open_streams{0};  // streamed responses not yet written to the end
  int listen_socket = -1;
  // stop() against listen() on another thread: cpp-httplib's stop() does nothing until listen_after_bind() has
  // marked the server running, so a stop that comes first (SIGTERM right after start) must be waited out or
  // make listen() return at once. Sequentially consistent: one of the two always sees the other's store.
  std::atomic<bool> stop_requested{false}, listen_started{false}, listen_returned{false};

  Impl(Scheduler& s, ServerMetrics& m, ExpertDistributionRecorder* r, HttpServerOptions o)
      : scheduler(s), metrics(m), recorder(r), options(std::move(o)) {}

  // Runs `handler`; an exception becomes an error response and the server keeps serving.
  template <typename F>
  httplib::Server::Handler guarded(F handler) {
    return [this, handler](const httplib::Request& req, httplib::Response& res) {
      try {
        handler(req, res);
      } catch (const ApiError& e) {
        metrics.on_request_rejected();
        send_json(res, e.status(), error_body(e.what(), e.type()));
      } catch (const std::exception& e) {
        metrics.on_request_rejected();
        send_json(res, 500, error_body(e.what(), "internal_error"));
      }
    };
  }

  void generation(Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
    const json body = parse_json_body(req.body);
    const ProtocolContext& ctx = options.protocol;
    ParsedRequest parsed = endpoint == Endpoint::kCompletion ? parse_completion_request(body, ctx)
                           : endpoint == Endpoint::kChat     ? parse_chat_request(body, ctx)
                                                             : parse_generate_request(body, ctx);
    // Every choice is its own request; one refused choice cancels the ones already submitted.
    std::vector<std::shared_ptr<ResponseWriter>> writers;
    try {
      for (RequestParams& params : parsed.requests) {
        std::vector<std::string> stop = params.stop;
        std::vector<int32_t> prompt = parsed.format.logprobs || parsed.format.echo ? params.prompt : std::vector<int32_t>();
        std::shared_ptr<RequestHandle> handle = scheduler.submit(std::move(params));
        writers.push_back(std::make_shared<ResponseWriter>(endpoint, handle, ctx.tokenizer, std::move(stop),
                                                           ctx.model_name, parsed.include_usage, parsed.prefill_only,
                                                           parsed.format, std::move(prompt)));
      }
    } catch (...) {
      for (const auto& w : writers) w->handle().cancel();
      throw;
    }
    if (!parsed.stream) {
      const ConnectionWatch watch(req.remote_addr, req.remote_port, req.local_port);
      std::vector<json> bodies;
      bool failed = false;
      for (const auto& w : writers) {
        bodies.push_back(w->complete([&watch] { return watch.peer_closed(); }));
        failed = failed || w->handle().finish_reason() == FinishReason::kError;
      }
      if (failed) {
        send_json(res, 500, error_body("the model step failed; see the server log", "internal_error"));
      } else {
        send_json(res, 200, merge_choices(endpoint, std::move(bodies), parsed.n, parsed.batched));
      }
      return;
    }
    std::shared_ptr<ResponseWriter> writer = writers.at(0);  // streaming: one choice (protocol.cpp)
    res.set_header("Cache-Control", "no-cache");
    ++open_streams;  // the releaser below runs exactly once, when the response goes
    res.set_chunked_content_provider(
        "text/event-stream",
        [writer](size_t, httplib::DataSink& sink) {
          if (writer->done()) {
            sink.done();
            return true;
          }
          std::string events = writer->next_events(std::chrono::milliseconds(1000));
          if (events.empty()) events = ": keep-alive\n\n";  // also finds out whether the client is still there
          if (!sink.write(events.data(), events.size())) {
            writer->handle().cancel();
            return false;
          }
          if (writer->done()) sink.done();
          return true;
        },
        [this, writer](bool success) {
          if (!success) writer->handle().cancel();
          --open_streams;
        });
  }

  void expert_distribution(const std::string& action, const httplib::Request& req, httplib::Response& res) {
    if (!recorder) throw ApiError(501, "not_implemented", "this executor records no expert distribution");
    if (action == "start") {
      recorder->start();
      send_json(res, 200, {{"status", "recording"}});
    } else if (action == "stop") {
      recorder->stop();
      send_json(res, 200, {{"status", "stopped"}});
    } else {
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
      send_json(res, 200, out);
    }
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

  void routes() {
    // --api-key: every route but /health and /metrics wants "Authorization: Bearer KEY" (401 otherwise, in
    // OpenAI's error shape).
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (options.api_key.empty() || req.path == "/health" || req.path == "/metrics") return httplib::Server::HandlerResponse::Unhandled;
      if (req.get_header_value("Authorization") == "Bearer " + options.api_key) return httplib::Server::HandlerResponse::Unhandled;
      metrics.on_request_rejected();
      send_json(res, 401, error_body("invalid or missing API key (send 'Authorization: Bearer KEY')", "authentication_error"));
      return httplib::Server::HandlerResponse::Handled;
    });
    http.Get("/get_model_info", guarded([this](const httplib::Request&, httplib::Response& res) {
      send_json(res, 200, model_info());
    }));
    for (const char* path : {"/get_server_info", "/server_info"}) {
      http.Get(path, guarded([this](const httplib::Request&, httplib::Response& res) { send_json(res, 200, server_info()); }));
    }
    http.Get("/health", guarded([this](const httplib::Request&, httplib::Response& res) {
      if (draining) throw ApiError(503, "unavailable", "shutting down");
      send_json(res, 200, {{"status", "ok"}});
    }));
    http.Get("/v1/models", guarded([this](const httplib::Request&, httplib::Response& res) {
      send_json(res, 200, {{"object", "list"},
                           {"data", json::array({{{"id", options.protocol.model_name}, {"object", "model"},
                                                  {"owned_by", "fulcrum"}, {"max_model_len", options.max_model_len},
                                                  {"vocab_size", options.vocab_size},
                                                  {"has_tokenizer", options.protocol.tokenizer != nullptr}}})}});
    }));
    http.Get("/metrics", guarded([this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics.render(scheduler.gauges()), "text/plain; version=0.0.4");
    }));
    const std::pair<const char*, Endpoint> generation_routes[] = {
        {"/v1/completions", Endpoint::kCompletion}, {"/v1/chat/completions", Endpoint::kChat},
        {"/generate", Endpoint::kGenerate}};
    for (const auto& [path, endpoint] : generation_routes) {
      http.Post(path, guarded([this, endpoint = endpoint](const httplib::Request& req, httplib::Response& res) {
        generation(endpoint, req, res);
      }));
    }
    for (const char* action : {"start", "stop", "dump"}) {
      const std::string path = fmt::format("/{}_expert_distribution_record", action);
      const auto handler = guarded([this, action](const httplib::Request& req, httplib::Response& res) {
        expert_distribution(action, req, res);
      });
      http.Post(path, handler);
      http.Get(path, handler);
    }
    // SGLang's endpoint: empties the prefix cache (pages running requests hold stay until they end).
    const auto flush = guarded([this](const httplib::Request&, httplib::Response& res) {
      const FlushResult r = scheduler.flush_cache();
      send_json(res, 200, {{"flushed_pages", r.flushed_pages}, {"in_use_pages", r.in_use_pages}});
    });
    http.Post("/flush_cache", flush);
    http.Get("/flush_cache", flush);
    // Unrouted paths and refusals by httplib itself (413, 400 on a bad request line) get a JSON body.
    // Our handlers always write a body (and count their refusals in guarded()); an empty one is httplib's own.
    http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      metrics.on_request_rejected();
      const std::string message = res.status == 404 ? fmt::format("no route for {} {}", printable_excerpt(req.method),
                                                                  printable_excerpt(req.path))
                                                    : fmt::format("HTTP {}", res.status);
      res.set_content(error_body(message, res.status == 404 ? "not_found" : "invalid_request_error").dump() + "\n",
                      "application/json");
    });
  }
};

HttpServer::HttpServer(Scheduler& scheduler, ServerMetrics& metrics, ExpertDistributionRecorder* recorder,
                       HttpServerOptions options)
    : impl_(std::make_unique<Impl>(scheduler, metrics, recorder, std::move(options))) {
  const int threads = impl_->options.threads;
  impl_->http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  impl_->http.set_payload_max_length(impl_->options.max_body_bytes);
  // Reuse connections for long (each reconnect costs an accept), and remember the listening socket:
  // bind() widens its backlog, which the packaged library fixes at 5 (a burst of clients would overflow it).
  impl_->http.set_keep_alive_max_count(100000);
  impl_->http.set_socket_options([impl = impl_.get()](int sock) {
    // SO_REUSEADDR only (a restart may bind while old connections sit in TIME_WAIT): httplib's default adds
    // SO_REUSEPORT, with which a second server on the same port starts and the kernel splits connections.
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    impl->listen_socket = sock;
  });
  impl_->routes();
}

HttpServer::~HttpServer() = default;

int HttpServer::bind(const std::string& host, int port) {
  const int bound = port == 0 ? impl_->http.bind_to_any_port(host) : (impl_->http.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) impl_->listen_socket = -1;  // httplib closed the socket it made
  FULCRUM_CHECK(bound > 0, "cannot listen on {}:{}: the port is in use, or the host is not an address of this machine",
                host, port);
  FULCRUM_CHECK(impl_->listen_socket >= 0 && ::listen(impl_->listen_socket, SOMAXCONN) == 0,
                "cannot widen the listen backlog on {}:{}", host, bound);
  return bound;
}

void HttpServer::listen() {
  impl_->listen_started = true;
  struct MarkReturned {
    std::atomic<bool>& flag;
    ~MarkReturned() { flag = true; }
  } mark{impl_->listen_returned};
  if (!impl_->stop_requested) {
    impl_->http.listen_after_bind();
  } else if (impl_->listen_socket >= 0) {
    ::close(impl_->listen_socket);  // httplib closes it only when its accept loop ends, which never started
    impl_->listen_socket = -1;
  }
}

void HttpServer::stop() {
  impl_->stop_requested = true;
  if (!impl_->listen_started) return;  // listen() has not begun: it sees stop_requested and returns
  while (!impl_->http.is_running() && !impl_->listen_returned) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  impl_->http.stop();
}

bool HttpServer::wait_streams_sent(double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (impl_->open_streams.load() > 0) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}
void HttpServer::set_draining() { impl_->draining = true; }

}  // namespace fulcrum::server
