#include "server/serve.hpp"

#include <chrono>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include <arpa/inet.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fmt/format.h>

#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "server/http_server.hpp"
#include "comm/tcp_communicator.hpp"
#include "server/engine_step_executor.hpp"
#ifdef FULCRUM_WITH_GPU_SERVE
#include "server/gpu_ranks_executor.hpp"
#include "server/gpu_step_executor.hpp"
#endif
#include "server/progress_bar.hpp"

namespace fulcrum::server {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
constexpr double kResponseGraceSeconds = 2;

void log(const std::string& line) {
  fmt::print(stderr, "fulcrum serve: {}\n", line);
  std::fflush(stderr);
}

bool wait_idle(const Scheduler& scheduler, double seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (!scheduler.idle()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// While the model loads nothing is served yet, so SIGINT / SIGTERM end the process at once (one line,
// exit status 128 + signal) instead of being noticed only once loading is over. Files written while
// loading (the weight cache) are written atomically: none is left half-written, and the temporary files of
// writes in progress are removed before the exit.
class SignalsDuringLoad {
 public:
  explicit SignalsDuringLoad(const sigset_t& signals) : signals_(signals), thread_([this] { watch(); }) {}
  ~SignalsDuringLoad() {
    loading_ = false;
    thread_.join();
  }

 private:
  void watch() {
    const timespec tick{0, 100'000'000};
    while (loading_) {
      const int s = sigtimedwait(&signals_, nullptr, &tick);
      if (s == SIGINT || s == SIGTERM) {
        abandon_atomic_writes();
        log(fmt::format("{} while loading: stopped", s == SIGINT ? "SIGINT" : "SIGTERM"));
        std::_Exit(128 + s);
      }
    }
  }

  sigset_t signals_;
  std::atomic<bool> loading_{true};
  std::thread thread_;  // last: starts once the members above exist
};

// Ranks as processes: joins the world (the mesh's liveness timeout bounds every wait on a silent peer).
std::shared_ptr<comm::PeerMesh> join_world(const ServeOptions& options) {
  comm::DistInit init = options.rank->dist_init();
  init.liveness_timeout = std::chrono::milliseconds(static_cast<int64_t>(options.elastic_ep_timeout_s * 1000));
  init.elastic = options.enable_elastic_ep;  // a failed rank restarted later can rejoin
  std::shared_ptr<comm::PeerMesh> mesh = comm::PeerMesh::connect(init);
  mesh->set_elastic(options.enable_elastic_ep);
  log(fmt::format("rank {} (pid {}) {} the world of {} at {}{}", options.rank->world_rank, ::getpid(),
                  mesh->joined_late() ? "rejoined" : "joined", options.rank->world_size, options.rank->dist_init_addr,
                  mesh->joined_late() ? " (world rank 0 brings it in at its next step)" : ""));
  return mesh;
}

EngineExecutorOptions engine_executor_options(const ServeOptions& options) {
  EngineExecutorOptions engine_options;
  engine_options.model_dir = options.model_dir;
  engine_options.parallel = options.parallel;
  engine_options.run = options.run;
  engine_options.kv_pages = options.scheduler.kv_pages;
  engine_options.page_size = options.scheduler.page_size;
  return engine_options;
}

// Each connection is a descriptor: the soft limit goes up to the hard one, and the log says when the hard one
// caps --max-connections.
void raise_fd_limit(int max_connections) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  if (lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }
  constexpr rlim_t kSpare = 256;  // model files, the engine's pipes, lingering refusals
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < static_cast<rlim_t>(max_connections) + kSpare) {
    log(fmt::format("note: the open-file limit is {}: fewer than --max-connections {} connections can be held",
                    lim.rlim_cur, max_connections));
  }
}

bool is_loopback(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  return ::inet_pton(AF_INET6, host.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

}  // namespace

void serve_worker_rank(const ServeOptions& options) {
  FULCRUM_CHECK(options.rank && options.rank->world_rank != 0, "serve_worker_rank: not a worker rank");
  // Ctrl-C reaches every process of the terminal's group: only the front end acts on it (it drains, then
  // stops this rank); SIGTERM (the launcher stopping the world) ends this rank at once.
  std::signal(SIGINT, SIG_IGN);
  std::signal(SIGPIPE, SIG_IGN);
  try {
    const std::shared_ptr<comm::PeerMesh> mesh = join_world(options);
    comm::TcpCommunicator world(mesh);
    EngineExecutorOptions engine_options = engine_executor_options(options);
    engine_options.process_world = &world;
    if (options.enable_elastic_ep) engine_options.elastic_mesh = mesh;
    EngineStepExecutor executor(std::move(engine_options));
    executor.serve_as_worker();
  } catch (const std::exception& e) {
    throw Error(fmt::format("rank {}: {}", options.rank->world_rank, e.what()));
  }
}

void serve(const ServeOptions& options) {
  if (options.rank && options.rank->world_rank != 0) {
    serve_worker_rank(options);
    return;
  }
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  FULCRUM_CHECK(pthread_sigmask(SIG_BLOCK, &signals, nullptr) == 0, "cannot block SIGINT/SIGTERM");
  std::signal(SIGPIPE, SIG_IGN);  // a vanished client must not kill the server

#ifdef FULCRUM_WITH_GPU_SERVE
  const bool on_gpu = serves_on_gpu(options.parallel, options.run);
  // GPU engine EP ranks as threads of this process (--tp W --dp W --enable-dp-attention --ep W, one node).
  const bool on_gpu_ranks = !options.rank && engine::runs_gpu_engine_ranks(options.parallel, options.run);
#else
  const bool on_gpu = false, on_gpu_ranks = false;
#endif
  FULCRUM_CHECK(options.load_format == "auto" || on_gpu || on_gpu_ranks,
                "--load-format dummy needs the GPU engine (--device cuda on one GPU or its EP ranks, in a CUDA build)");
  auto load_signals = std::make_unique<SignalsDuringLoad>(signals);
  const auto load_start = Clock::now();
  log(fmt::format("loading {}", options.model_dir));
  ServerMetrics metrics;
  // The bar counts layers loaded over every rank; it starts with the first one (when the total is known).
  std::unique_ptr<ProgressBar> progress;
  const auto on_layers_loaded = [&progress](int done, int total) {
    if (!progress) {
      progress = std::make_unique<ProgressBar>("fulcrum serve: loading weights", total, "layers");
      progress->tick_every_second();  // the clock moves while a large layer loads
    }
    progress->update(done);
  };
  // One GPU: the GPU engine (the whole step on the device); otherwise the parallel engine's ranks.
  // Ranks as processes: the world this front end drives (declared before the executor, which uses it).
  std::shared_ptr<comm::PeerMesh> mesh;
  std::unique_ptr<comm::TcpCommunicator> process_world;
  if (options.rank) {
    mesh = join_world(options);
    process_world = std::make_unique<comm::TcpCommunicator>(mesh);
  }
  std::unique_ptr<StepExecutor> executor_owner;
  const model::Qwen3MoeConfig* config = nullptr;
  ExpertDistributionRecorder* recorder = nullptr;
  std::string where;
  bool eplb_on = false;
#ifdef FULCRUM_WITH_GPU_SERVE
  if (on_gpu || on_gpu_ranks) {
    const GpuExecutorOptions gpu_options{options.model_dir, options.parallel, options.run, options.scheduler,
                                         on_layers_loaded, options.load_format == "dummy", &metrics};
    const auto take = [&](auto gpu) {  // one GPU, or the GPU engine's EP ranks
      config = &gpu->config();
      recorder = gpu->recorder();
      where = gpu->describe();
      executor_owner = std::move(gpu);
    };
    if (on_gpu) {
      take(std::make_unique<GpuStepExecutor>(gpu_options));
    } else {
      take(std::make_unique<GpuRanksExecutor>(gpu_options));
      eplb_on = options.run.eplb.enabled;
    }
  }
#endif
  if (!executor_owner) {
    EngineExecutorOptions engine_options = engine_executor_options(options);
    engine_options.metrics = &metrics;
    engine_options.on_layers_loaded = on_layers_loaded;
    engine_options.process_world = process_world.get();
    if (options.enable_elastic_ep) engine_options.elastic_mesh = mesh;
    auto cpu = std::make_unique<EngineStepExecutor>(std::move(engine_options));
    config = &cpu->config();
    recorder = cpu->recorder();
    where = cpu->layout().describe() + (options.rank ? fmt::format(", {} rank processes", options.rank->world_size) : "");
    eplb_on = cpu->eplb_enabled();
    executor_owner = std::move(cpu);
  }
  StepExecutor& executor = *executor_owner;
  progress.reset();
  std::unique_ptr<tokenizer::Tokenizer> tok;
  const fs::path tokenizer_file = fs::path(options.model_dir) / "tokenizer.json";
  if (fs::exists(tokenizer_file)) {
    tok = std::make_unique<tokenizer::Tokenizer>(tokenizer::Tokenizer::from_file(tokenizer_file.string()));
    FULCRUM_CHECK(tok->id_bound() <= executor.vocab_size(), "{}: token ids reach {}, the model's vocab_size is {}",
                  tokenizer_file.string(), tok->id_bound(), executor.vocab_size());
  }
  HttpServerOptions http_options;
  ProtocolContext& ctx = http_options.protocol;
  ctx.tokenizer = tok.get();
  ctx.model_name = options.served_model_name.empty() ? fs::absolute(options.model_dir).lexically_normal().filename().string()
                                                     : options.served_model_name;
  if (ctx.model_name.empty()) ctx.model_name = fs::absolute(options.model_dir).parent_path().filename().string();
  ctx.default_max_tokens = options.default_max_tokens;
  if (tok) {
    for (const char* eos : {"<|endoftext|>", "<|im_end|>"}) {
      if (const auto id = tok->token_to_id(eos)) ctx.eos_token_ids.push_back(*id);
    }
  }
  http_options.max_model_len = executor.max_sequence_length();
  http_options.vocab_size = executor.vocab_size();
  http_options.expert_distribution_dir = options.expert_distribution_dir;
  http_options.transport = options.http;
  http_options.max_queued_requests = options.max_queued_requests;
  http_options.cors_allow_origin = options.cors_allow_origin;
  http_options.access_log = options.access_log;
  http_options.api_key = options.api_key;
  http_options.model_path = options.model_dir;
  http_options.server_info = {
      {"tp_size", options.parallel.tp}, {"dp_size", options.parallel.dp}, {"ep_size", options.parallel.ep},
      {"pp_size", options.parallel.pp}, {"enable_dp_attention", options.parallel.enable_dp_attention},
      {"ep_num_redundant_experts", options.parallel.num_redundant_experts},
      {"moe_a2a_backend", options.run.engine.moe_a2a_backend}, {"enable_eplb", eplb_on}, {"device", options.run.device},
      {"max_running_requests", options.scheduler.max_running_requests}, {"page_size", options.scheduler.page_size},
      {"kv_pages", options.scheduler.kv_pages}, {"chunked_prefill_size", options.scheduler.max_prefill_tokens},
      {"layout", where}};

  Detokenizer detokenizer;
  if (tok) {
    detokenizer = [t = tok.get()](std::span<const int32_t> ids) { return t->decode({ids.begin(), ids.end()}); };
  }
  Scheduler scheduler(executor, options.scheduler, detokenizer, &metrics);
  HttpServer http(scheduler, metrics, recorder, http_options);
  const int port = http.bind(options.host, options.port);
  raise_fd_limit(options.http.max_connections);
  if (options.api_key.empty() && !is_loopback(options.host)) {
    log(fmt::format("warning: listening on {} (not a loopback address) without --api-key: anyone who can reach the "
                    "port can use the server", options.host));
  }
  // A failure on either thread must not terminate the process: it is kept, the main thread is woken as by
  // SIGTERM, shuts down the other thread, and rethrows it (one-line error, non-zero exit).
  std::exception_ptr thread_error;
  std::mutex thread_error_mutex;
  const auto guarded = [&](auto body) {
    return [&, body] {
      try {
        body();
      } catch (...) {
        std::lock_guard lock(thread_error_mutex);
        if (!thread_error) thread_error = std::current_exception();
        ::kill(::getpid(), SIGTERM);
      }
    };
  };
  load_signals.reset();  // from here on the main thread's sigwait below takes them
  std::thread loop(guarded([&] { scheduler.run(); }));
  std::thread listener(guarded([&] { http.listen(); }));
  const double load_s = std::chrono::duration<double>(Clock::now() - load_start).count();
  log(fmt::format("model '{}' ({} layers, {} experts, vocab {}{}), loaded in {:.2f} s on {}{}; {} KV pages of {} tokens{}, "
                  "prefix cache {}, up to {} running requests, {} prefill tokens per step",
                  ctx.model_name, config->num_hidden_layers, config->num_experts,
                  executor.vocab_size(), tok ? ", tokenizer.json" : ", no tokenizer: token ids only", load_s,
                  where, eplb_on ? ", EPLB on" : "", options.scheduler.kv_pages, options.scheduler.page_size,
                  executor.num_kv_groups() > 1 ? fmt::format(" per attention-DP group ({})", executor.num_kv_groups()) : "",
                  options.scheduler.prefix_cache ? "on" : "off (--disable-radix-cache)",
                  options.scheduler.max_running_requests, options.scheduler.max_prefill_tokens));
  log(fmt::format("listening on http://{}:{}", options.host, port));

  int signal = 0;
  sigwait(&signals, &signal);
  log(fmt::format("{}: draining (new requests get 503)", signal == SIGINT ? "SIGINT" : "SIGTERM"));
  http.set_draining();
  scheduler.stop_accepting();
  if (!wait_idle(scheduler, options.shutdown_timeout_s)) {
    const QueueGauges g = scheduler.gauges();
    log(fmt::format("cancelling {} running and {} waiting request(s) after {:.0f} s", g.running, g.waiting,
                    options.shutdown_timeout_s));
    scheduler.cancel_all();
    wait_idle(scheduler, kResponseGraceSeconds);  // cancelled requests end at the next step
  }
  // Every request is finished or cancelled: let each response write its last bytes ([DONE] included), then
  // close every connection (idle ones and those still sending headers too).
  if (!http.wait_responses_sent(kResponseGraceSeconds)) {
    log(fmt::format("closing responses still being written after {} s", kResponseGraceSeconds));
  }
  http.stop();
  listener.join();
  scheduler.stop();
  loop.join();
  if (thread_error) std::rethrow_exception(thread_error);
  log("stopped");
}

}  // namespace fulcrum::server
