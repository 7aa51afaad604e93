#include "server/metrics.hpp"

#include <fmt/format.h>

namespace fulcrum::server {
namespace {

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

}  // namespace

void ServerMetrics::on_request_rejected(std::string_view reason) {
  size_t i = 0;
  while (i + 1 < kRejectionReasons.size() && reason != kRejectionReasons[i]) ++i;  // the last one is "other"
  rejected_[i].fetch_add(1);
}

void ServerMetrics::on_request_finished(const std::string& finish_reason) {
  std::lock_guard lock(mutex_);
  for (auto& [reason, count] : finished_) {
    if (reason == finish_reason) {
      ++count;
      return;
    }
  }
  finished_.emplace_back(finish_reason, 1);
}

void ServerMetrics::observe_step(double seconds, int64_t batch_tokens) {
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < kStepBuckets.size(); ++i) {
    if (seconds <= kStepBuckets[i]) ++step_buckets_[i];  // cumulative buckets
  }
  ++step_count_;
  step_sum_ += seconds;
  batch_tokens_ += batch_tokens;
}

void ServerMetrics::add_scheduler_host_seconds(double seconds) {
  std::lock_guard lock(mutex_);
  scheduler_host_sum_ += seconds;
}

void ServerMetrics::set_eplb_balancedness(const std::vector<double>& per_layer, double mean) {
  std::lock_guard lock(mutex_);
  balancedness_ = per_layer;
  balancedness_mean_ = mean;
  has_balancedness_ = true;
}

void ServerMetrics::set_live_ranks(int n) {
  std::lock_guard lock(mutex_);
  live_ranks_ = n;
}

void ServerMetrics::add_elastic_recovery(double seconds) {
  std::lock_guard lock(mutex_);
  ++recoveries_;
  last_recovery_s_ = seconds;
  recovery_s_sum_ += seconds;
}

void ServerMetrics::add_reprefilled_requests(int64_t n) {
  std::lock_guard lock(mutex_);
  reprefilled_ += n;
}

void ServerMetrics::add_eplb_rebalance(int64_t bytes_migrated) {
  std::lock_guard lock(mutex_);
  ++rebalances_;
  bytes_migrated_ += bytes_migrated;
}

std::string ServerMetrics::render(const QueueGauges& g) const {
  std::lock_guard lock(mutex_);
  std::string out;
  header(out, "fulcrum_requests_total", "counter", "Finished requests by finish reason.");
  if (finished_.empty()) out += "fulcrum_requests_total{finish_reason=\"stop\"} 0\n";
  for (const auto& [reason, count] : finished_) {
    out += fmt::format("fulcrum_requests_total{{finish_reason=\"{}\"}} {}\n", reason, count);
  }
  header(out, "fulcrum_requests_rejected_total", "counter", "Requests refused with a 4xx or 5xx before running, by reason.");
  for (size_t i = 0; i < kRejectionReasons.size(); ++i) {
    out += fmt::format("fulcrum_requests_rejected_total{{reason=\"{}\"}} {}\n", kRejectionReasons[i], rejected_[i].load());
  }
  header(out, "fulcrum_requests_running", "gauge", "Requests in the running batch.");
  out += fmt::format("fulcrum_requests_running {}\n", g.running);
  header(out, "fulcrum_requests_waiting", "gauge", "Requests queued for admission.");
  out += fmt::format("fulcrum_requests_waiting {}\n", g.waiting);
  header(out, "fulcrum_prompt_tokens_total", "counter", "Prompt tokens prefilled or read from the prefix cache.");
  out += fmt::format("fulcrum_prompt_tokens_total {}\n", prompt_tokens_.load());
  header(out, "fulcrum_generation_tokens_total", "counter", "Tokens generated.");
  out += fmt::format("fulcrum_generation_tokens_total {}\n", generation_tokens_.load());
  header(out, "fulcrum_step_seconds", "histogram", "Wall time of one forward step of the running batch.");
  for (size_t i = 0; i < kStepBuckets.size(); ++i) {
    out += fmt::format("fulcrum_step_seconds_bucket{{le=\"{}\"}} {}\n", kStepBuckets[i], step_buckets_[i]);
  }
  out += fmt::format("fulcrum_step_seconds_bucket{{le=\"+Inf\"}} {}\n", step_count_);
  out += fmt::format("fulcrum_step_seconds_sum {}\nfulcrum_step_seconds_count {}\n", step_sum_, step_count_);
  header(out, "fulcrum_scheduler_host_seconds_total", "counter",
         "Scheduler time around the forward steps (admission, batching, handing out tokens): host work between steps.");
  out += fmt::format("fulcrum_scheduler_host_seconds_total {}\n", scheduler_host_sum_);
  header(out, "fulcrum_step_tokens_total", "counter", "Tokens run through forward steps (prefill and decode).");
  out += fmt::format("fulcrum_step_tokens_total {}\n", batch_tokens_);
  header(out, "fulcrum_kv_pages_used", "gauge", "KV cache pages held by running requests (a page shared by several counts once).");
  out += fmt::format("fulcrum_kv_pages_used {}\n", g.kv_pages_used);
  header(out, "fulcrum_kv_pages_total", "gauge", "KV cache pages in the pool (of every attention-DP group).");
  out += fmt::format("fulcrum_kv_pages_total {}\n", g.kv_pages_total);
  header(out, "fulcrum_prefix_cache_enabled", "gauge", "1 when prompt prefixes share KV pages (0: --disable-radix-cache).");
  out += fmt::format("fulcrum_prefix_cache_enabled {}\n", g.prefix_cache_enabled ? 1 : 0);
  header(out, "fulcrum_prefix_cache_pages", "gauge", "KV pages in the prefix cache, held by running requests or evictable.");
  out += fmt::format("fulcrum_prefix_cache_pages {}\n", g.prefix_cache_pages);
  header(out, "fulcrum_prefix_cache_evicted_pages_total", "counter", "Cached KV pages evicted to make room.");
  out += fmt::format("fulcrum_prefix_cache_evicted_pages_total {}\n", g.prefix_cache_evicted_pages);
  header(out, "fulcrum_prefix_cache_dropped_pages_total", "counter",
         "Cached KV pages dropped, index and all, with the KV pools an elastic EP recovery rebuilt.");
  out += fmt::format("fulcrum_prefix_cache_dropped_pages_total {}\n", g.prefix_cache_dropped_pages);
  header(out, "fulcrum_prefix_cache_hit_tokens_total", "counter", "Prompt tokens read from the prefix cache.");
  out += fmt::format("fulcrum_prefix_cache_hit_tokens_total {}\n", g.prefix_cache_hit_tokens);
  header(out, "fulcrum_prefix_cache_hit_ratio", "gauge",
         "Prompt tokens read from the prefix cache over prompt tokens of admitted requests, since start (0 before any).");
  out += fmt::format("fulcrum_prefix_cache_hit_ratio {}\n",
                     g.admitted_prompt_tokens > 0 ? static_cast<double>(g.prefix_cache_hit_tokens) /
                                                        static_cast<double>(g.admitted_prompt_tokens)
                                                  : 0.0);
  header(out, "fulcrum_eplb_balancedness", "gauge",
         "Balancedness (mean GPU load / max GPU load) of the live placement on the recorder's window, per MoE layer.");
  for (size_t l = 0; l < balancedness_.size(); ++l) {
    out += fmt::format("fulcrum_eplb_balancedness{{layer=\"{}\"}} {}\n", l, balancedness_[l]);
  }
  header(out, "fulcrum_eplb_balancedness_mean", "gauge",
         "Balancedness averaged over MoE layers (NaN before the first measurement).");
  out += fmt::format("fulcrum_eplb_balancedness_mean {}\n", has_balancedness_ ? fmt::format("{}", balancedness_mean_) : "NaN");
  header(out, "fulcrum_eplb_rebalances_total", "counter", "Expert rebalances that changed the placement.");
  out += fmt::format("fulcrum_eplb_rebalances_total {}\n", rebalances_);
  header(out, "fulcrum_eplb_bytes_migrated_total", "counter", "Expert weight bytes the rebalances moved between EP ranks.");
  out += fmt::format("fulcrum_eplb_bytes_migrated_total {}\n", bytes_migrated_);
  header(out, "fulcrum_live_ranks", "gauge", "Rank processes in the engine's world now (elastic EP drops lost ones).");
  out += fmt::format("fulcrum_live_ranks {}\n", live_ranks_);
  header(out, "fulcrum_elastic_recoveries_total", "counter", "Worlds re-formed without a lost rank (elastic EP).");
  out += fmt::format("fulcrum_elastic_recoveries_total {}\n", recoveries_);
  header(out, "fulcrum_elastic_recovery_seconds", "gauge",
         "The last recovery's time, from the fault detected to the first completed step (0 before any).");
  out += fmt::format("fulcrum_elastic_recovery_seconds {}\n", last_recovery_s_);
  header(out, "fulcrum_elastic_recovery_seconds_sum", "counter", "Time of every recovery so far, summed.");
  out += fmt::format("fulcrum_elastic_recovery_seconds_sum {}\n", recovery_s_sum_);
  header(out, "fulcrum_elastic_reprefilled_requests_total", "counter",
         "Requests re-prefilled (prompt and tokens so far) after a recovery.");
  out += fmt::format("fulcrum_elastic_reprefilled_requests_total {}\n", reprefilled_);
  return out;
}

}  // namespace fulcrum::server
