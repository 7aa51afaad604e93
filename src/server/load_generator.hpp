#pragma once
// `fulcrum bench serve`: closed-loop load on a running server over loopback. N client threads each send
// streaming /v1/completions requests (random token-id prompts of a length drawn from [min, max], fixed
// max_tokens, ignore_eos) one after another until the request count (or the duration) is reached, and
// time every SSE token event: TTFT = first token - send, ITL = gaps between later tokens. With a shared
// prefix every prompt starts with the same random token ids (a few-shot prompt, a system prompt), and the
// server's prefix-cache counters on /metrics are read before and after the run.
#include <cstdint>
#include <string>
#include <vector>

namespace fulcrum::server {

struct LoadOptions {
  std::string url = "http://127.0.0.1:8000";
  int clients = 8;
  int requests = 64;         // total over all clients (ignored when duration_s > 0)
  double duration_s = 0;     // > 0: send until this many seconds passed
  int prompt_min = 16;
  int prompt_max = 64;
  int max_tokens = 32;
  int shared_prefix = 0;  // tokens every prompt starts with (before its own prompt_min..prompt_max tokens)
  uint64_t seed = 0;
};

struct LoadReport {
  int succeeded = 0;
  int failed = 0;
  double seconds = 0;
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;
  std::vector<double> ttft_s;     // per request
  std::vector<double> itl_s;      // per token gap
  std::vector<double> latency_s;  // per request
  std::vector<std::string> errors;  // the first few failures
  // The server's /metrics counters over the run (-1 when it has none): prompt tokens admitted, those read
  // from its prefix cache, and tokens run through forward steps (prefill and decode computed).
  int64_t server_prompt_tokens = -1, server_hit_tokens = -1, server_step_tokens = -1;
  // Forward steps over the run, their mean wall time, and the scheduler's host time per step around them
  // (fulcrum_step_seconds, fulcrum_scheduler_host_seconds_total; -1 when the server has none): what of the
  // inter-token latency is the step and what is host work between steps.
  int64_t server_steps = -1;
  double server_step_ms_mean = -1, server_host_ms_per_step = -1;
};

LoadReport run_load(const LoadOptions& options);

// Value at quantile q in [0, 1] (nearest rank); 0 for an empty list.
double percentile(std::vector<double> values, double q);

std::string format_load_report(const LoadOptions& options, const LoadReport& report);

}  // namespace fulcrum::server
