// `fulcrum serve` and `fulcrum bench serve`: the OpenAI-compatible server and its load generator (both
// here, built with FULCRUM_BUILD_SERVER, so the pair stays together).
#include <cstdio>
#include <memory>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/dist_flags.hpp"
#include "eplb/atomic_file.hpp"
#include "cli/engine_flags.hpp"
#include "cli/number_checks.hpp"
#include "eplb/error.hpp"
#include "server/load_generator.hpp"
#include "server/elastic_world.hpp"
#include "server/serve.hpp"

namespace fulcrum::cli {
namespace {

void parse_range(const std::string& text, int& lo, int& hi) {
  const size_t colon = text.find(':');
  try {
    lo = std::stoi(text.substr(0, colon));
    hi = colon == std::string::npos ? lo : std::stoi(text.substr(colon + 1));
  } catch (const std::exception&) {
    throw Error(fmt::format("--prompt-len: '{}' is not A:B", text));
  }
}

}  // namespace

void register_serve_command(CLI::App& app) {
  auto o = std::make_shared<server::ServeOptions>();
  auto engine_flags = std::make_shared<EngineFlags>();
  CLI::App* cmd = app.add_subcommand("serve", "Serve a Qwen3-MoE checkpoint over HTTP (OpenAI-compatible)");
  cmd->add_option("--model,--model-path", o->model_dir,
                  "Checkpoint folder (config.json, *.safetensors, optional tokenizer.json)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--host", o->host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", o->port, "Port (0: any free port; the log names it)")->capture_default_str()->check(CLI::Range(0, 65535));
  cmd->add_option("--max-running-requests", o->scheduler.max_running_requests, "Requests in the running batch")
      ->capture_default_str()->check(kPositive);
  cmd->add_option("--kv-pages", o->scheduler.kv_pages, "KV cache pool, in pages (of each attention-DP group)")
      ->capture_default_str()->check(kPositive);
  cmd->add_option("--page-size", o->scheduler.page_size, "Tokens per KV page")->capture_default_str()->check(kPositive);
  cmd->add_option("--max-prefill-tokens", o->scheduler.max_prefill_tokens, "Prompt tokens per step (chunked prefill)")
      ->capture_default_str()->check(kPositive);
  cmd->add_flag_callback("--disable-radix-cache", [o] { o->scheduler.prefix_cache = false; },
                         "Turn prefix caching off (on by default: requests share the KV pages of common prompt prefixes)");
  cmd->add_option("--default-max-tokens", o->default_max_tokens, "max_tokens of requests that give none")
      ->capture_default_str()->check(kPositive);
  cmd->add_option("--load-format", o->load_format,
                  "auto (read the checkpoint) | dummy (random weights on the GPU: config.json only; benchmarks)")
      ->capture_default_str()->check(CLI::IsMember({"auto", "dummy"}));
  cmd->add_option("--served-model-name", o->served_model_name, "Model id in the API (default: the folder name)");
  cmd->add_option("--expert-distribution-dir", o->expert_distribution_dir,
                  "Folder /dump_expert_distribution_record writes to")->capture_default_str();
  cmd->add_option("--api-key", o->api_key,
                  "Require 'Authorization: Bearer KEY' on every route but /health and /metrics (401 otherwise)");
  cmd->add_option("--shutdown-timeout", o->shutdown_timeout_s, "Seconds in-flight requests may take after SIGTERM")
      ->capture_default_str()->check(kNonNegative);
  // HTTP front end limits (src/server/http_wire.hpp, http_transport.hpp; README "Serving").
  cmd->add_option("--max-body-bytes", o->http.limits.max_body_bytes,
                  "Largest request body, chunked or not (413 beyond, counted while reading)")
      ->capture_default_str()->check(kPositive);
  cmd->add_option("--max-header-bytes", o->http.limits.max_header_bytes,
                  "Largest request line + headers, at most 81920 (431 beyond)")
      ->capture_default_str()->check(CLI::Range(1, 81920));
  cmd->add_option("--max-headers", o->http.limits.max_headers, "Most request headers (431 beyond)")
      ->capture_default_str()->check(kPositive);
  cmd->add_option("--header-timeout", o->http.header_timeout_s,
                  "Seconds from a request's first byte to the end of its headers (408 beyond)")
      ->capture_default_str()->check(kPositive);
  cmd->add_option("--idle-timeout", o->http.idle_timeout_s,
                  "Seconds a keep-alive connection may sit with no request (or a body with no byte) before it is closed")
      ->capture_default_str()->check(kPositive);
  cmd->add_option("--max-connections", o->http.max_connections,
                  "Open connections held; one beyond gets 503 with Retry-After and is closed")
      ->capture_default_str()->check(kPositive);
  cmd->add_option("--max-queued-requests", o->max_queued_requests,
                  "Generation requests waiting for admission; beyond: 429 with Retry-After")
      ->capture_default_str()->check(kPositive);
  cmd->add_option("--request-timeout", o->http.request_timeout_s,
                  "Seconds a generation request may take (0: no limit); past it it is cancelled (its KV freed) and "
                  "answered 504, or a stream ends with an error event")
      ->capture_default_str()->check(kNonNegative);
  cmd->add_option("--cors-allow-origin", o->cors_allow_origin,
                  "Send Access-Control-Allow-Origin with this value ('*' or an origin) and answer OPTIONS preflights");
  cmd->add_flag("--access-log", o->access_log,
                "One stderr line per answered request: method, path, status, latency, tokens");
  EngineFlags::add_to(cmd, engine_flags);
  auto dist = std::make_shared<engine::DistFlags>();
  add_dist_flags(cmd, *dist);
  cmd->add_option("--elastic-ep-timeout", o->elastic_ep_timeout_s,
                  "Ranks as processes: seconds after which a rank that sent nothing, not even a heartbeat, has "
                  "failed (a hung or stopped process, a cut link); every wait on a peer is bounded by it")
      ->capture_default_str()->check(kPositive);
  cmd->add_flag("--enable-elastic-ep", o->enable_elastic_ep,
                "Ranks as processes: survive a lost rank other than world rank 0 (killed, stopped or cut off): the "
                "others form a new world without it, re-plan the experts over the survivors and re-prefill every live "
                "request (the prefix cache, whose pages went with the old KV pools, is dropped and refills). Needs "
                "--enable-dp-attention with --dp = --tp = --ep and --pp 1. A lost rank R restarted with the same flags "
                "plus --nnodes N --node-rank R --dist-init-addr HOST:PORT (N ranks, the address its log line 'joined "
                "the world of N at HOST:PORT' names) rejoins");
  cmd->callback([o, engine_flags, dist] {
    const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(o->model_dir);
    o->parallel = engine_flags->resolved_parallel();
    const engine::ParallelLayout layout(o->parallel, config);
    o->run = engine_flags->make_run(layout, config);
    o->rank = engine::launched_rank();
    if (o->enable_elastic_ep) {
      FULCRUM_CHECK(engine::runs_as_processes(*dist, o->run.device, layout.world_size()),
                    "--enable-elastic-ep needs ranks as processes (--multi-process with --device cpu)");
      const std::string why = server::why_elastic_ep_cannot_run(o->parallel, o->run.device);
      FULCRUM_CHECK(why.empty(), "{}", why);
    }
    // Ranks as processes on cpu (cuda ranks of the parallel engine are not served yet: serve says so).
    if (!o->rank && o->run.device == "cpu" && engine::runs_as_processes(*dist, o->run.device, layout.world_size())) {
      engine::validate_dist_flags(*dist, layout.world_size());
      engine::launch_rank_processes(*dist, layout.world_size(), o->run.device,
                                    {.stream_stderr = true, .forward_signals = true,
                                     .survive_lost_ranks = o->enable_elastic_ep});
      return;
    }
    server::serve(*o);
  });
}

void register_bench_serve_command(CLI::App& bench) {
  auto l = std::make_shared<server::LoadOptions>();
  auto prompt_len = std::make_shared<std::string>("16:64");
  CLI::App* load = bench.add_subcommand("serve", "Load a running server with concurrent streaming clients");
  load->add_option("--url", l->url, "Server base URL")->capture_default_str();
  load->add_option("--clients", l->clients, "Concurrent clients")->capture_default_str();
  load->add_option("--requests", l->requests, "Requests in total")->capture_default_str();
  load->add_option("--duration", l->duration_s, "Run for this many seconds instead of --requests");
  load->add_option("--prompt-len", *prompt_len, "Prompt length range A:B (uniform, token ids)")->capture_default_str();
  load->add_option("--max-tokens", l->max_tokens, "Tokens generated per request")->capture_default_str();
  load->add_option("--shared-prefix", l->shared_prefix,
                   "Every prompt starts with these many shared random token ids, then its own --prompt-len ones "
                   "(a few-shot prefix: exercises the server's prefix cache)")
      ->capture_default_str()->check(kNonNegative);
  load->add_option("--seed", l->seed, "Prompt seed")->capture_default_str();
  auto json_path = std::make_shared<std::string>();
  auto git_commit = std::make_shared<std::string>();
  load->add_option("--json", *json_path, "Write the figures here (JSON; written whole or not at all)");
  load->add_option("--git-commit", *git_commit, "Commit recorded in the JSON");
  load->callback([l, prompt_len, json_path, git_commit] {
    parse_range(*prompt_len, l->prompt_min, l->prompt_max);
    const server::LoadReport report = server::run_load(*l);
    fmt::print("{}", server::format_load_report(*l, report));
    if (!json_path->empty()) {
      const auto pct = [](const std::vector<double>& v) {
        return nlohmann::json{{"p50", server::percentile(v, 0.5)}, {"p90", server::percentile(v, 0.9)},
                              {"p99", server::percentile(v, 0.99)}};
      };
      const nlohmann::json doc{{"command", command_line()}, {"git_commit", *git_commit}, {"clients", l->clients},
                               {"prompt_len", *prompt_len}, {"shared_prefix", l->shared_prefix},
                               {"max_tokens", l->max_tokens}, {"succeeded", report.succeeded},
                               {"failed", report.failed}, {"seconds", report.seconds},
                               {"output_tokens_per_s", report.output_tokens / std::max(report.seconds, 1e-9)},
                               {"requests_per_s", report.succeeded / std::max(report.seconds, 1e-9)},
                               {"ttft_s", pct(report.ttft_s)}, {"itl_s", pct(report.itl_s)},
                               {"latency_s", pct(report.latency_s)},
                               {"server_prompt_tokens", report.server_prompt_tokens},
                               {"server_prefix_cache_hit_tokens", report.server_hit_tokens},
                               {"server_step_tokens", report.server_step_tokens},
                               {"server_steps", report.server_steps},
                               {"server_step_ms_mean", report.server_step_ms_mean},
                               {"server_host_ms_per_step", report.server_host_ms_per_step}};
      write_file_atomically(*json_path, doc.dump(2) + "\n");
    }
    FULCRUM_CHECK(report.failed == 0, "{} of {} requests failed", report.failed, report.failed + report.succeeded);
  });
}

}  // namespace fulcrum::cli
