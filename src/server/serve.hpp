#pragma once
// `fulcrum serve`: loads a checkpoint into an EngineStepExecutor (the parallel engine's ranks as threads,
// live EPLB when asked; a progress bar on stderr while weights load), runs the scheduler loop on its own thread
// and the HTTP event loop on another, logs "listening on http://HOST:PORT" once ready, and on SIGINT/SIGTERM
// shuts down gracefully: /health turns 503 and new requests are refused (503), in-flight requests finish
// (or, past shutdown_timeout_s, are cancelled and answered with finish_reason "cancelled"), responses get
// 2 s to be written, then every connection closes: the process exits within
// shutdown_timeout_s + 4 s (plus one model step) whatever the clients do.
#include <optional>
#include <string>

#include "engine/multi_process_run.hpp"
#include "engine/parallel_generate.hpp"
#include "server/http_transport.hpp"
#include "server/scheduler.hpp"

namespace fulcrum::server {

struct ServeOptions {
  std::string model_dir;
  engine::ParallelFlags parallel;
  engine::InProcessRun run;  // device, weight cache, placement, dispatch, EPLB (cli/engine_flags.hpp)
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (the log line names it)
  SchedulerOptions scheduler;
  int default_max_tokens = 128;
  std::string load_format = "auto";  // dummy: random weights on the GPU engine (benchmarks; config.json only)
  std::string served_model_name;  // empty: the model folder's name
  std::string expert_distribution_dir = ".";
  double shutdown_timeout_s = 30;
  std::string api_key;  // --api-key: Bearer auth on every route but /health and /metrics
  // Ranks as processes (--multi-process): the rank this process is, as its launcher said. World rank 0 runs
  // the HTTP front end and the scheduler; the others run the engine's commands (serve_as_worker).
  std::optional<engine::LaunchedRank> rank;
  double elastic_ep_timeout_s = 30;  // --elastic-ep-timeout: a rank silent this long has failed
  bool enable_elastic_ep = false;    // --enable-elastic-ep: survive lost ranks (elastic_world.hpp)
  HttpTransportOptions http;     // body / header limits, header and idle timeouts, --max-connections, --request-timeout
  int max_queued_requests = 1024;
  std::string cors_allow_origin;
  bool access_log = false;
};

// Ranks as processes: what serve() does on a rank other than world rank 0. Returns when rank 0 stops it.
void serve_worker_rank(const ServeOptions& options);

// Blocks until a SIGINT or SIGTERM has been handled; throws (after shutting down) when the engine's ranks
// or the server's threads failed. Call before starting other threads (it blocks the
// two signals in the calling thread so every thread it starts inherits the mask).
void serve(const ServeOptions& options);

}  // namespace fulcrum::server
