#pragma once
// Server metrics in Prometheus text format (exposition format 0.0.4). Counters and the step-time
// histogram are updated by the scheduler; gauges of the queue and KV pool are sampled when rendered.
// EPLB gauges (balancedness per layer and mean, rebalances, bytes migrated) are set by the executor that
// runs the EPLB loop (EngineStepExecutor) through set_eplb_*; they read NaN / 0 / absent until then.
#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace fulcrum::server {

struct QueueGauges {
  int64_t running = 0;
  int64_t waiting = 0;
  int64_t kv_pages_used = 0;   // pages running requests hold (a shared page once)
  int64_t kv_pages_total = 0;  // over every attention-DP group's pool
  // Prefix cache (scheduler.hpp, prefix_cache.hpp), summed over groups.
  bool prefix_cache_enabled = false;
  int64_t prefix_cache_pages = 0;          // pages in the index (in use or evictable)
  int64_t prefix_cache_evicted_pages = 0;  // evicted to make room, since start (a counter)
  int64_t prefix_cache_hit_tokens = 0;     // prompt tokens read from the cache, since start (a counter)
  int64_t prefix_cache_dropped_pages = 0;  // dropped with KV pools an elastic EP recovery rebuilt (a counter)
  int64_t admitted_prompt_tokens = 0;      // prompt tokens of admitted requests, since start (a counter)
};

class ServerMetrics {
 public:
  // Upper bounds (seconds) of the step-time histogram buckets; +Inf is implicit.
  static constexpr std::array<double, 12> kStepBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                          0.1,   0.25,   0.5,   1.0,  2.5,   5.0};

  void on_request_finished(const std::string& finish_reason);  // "stop", "length", "cancelled", "error"
  // Why requests are refused before running: the `reason` label of fulcrum_requests_rejected_total (each series
  // is always rendered, 0 until counted). Another reason counts as "other".
  static constexpr std::array<const char*, 11> kRejectionReasons = {
      "bad_request", "unauthorized", "not_found", "header_timeout", "body_too_large", "queue_full",
      "headers_too_large", "not_implemented", "unavailable", "internal_error", "other"};
  void on_request_rejected(std::string_view reason);
  void add_prompt_tokens(int64_t n) { prompt_tokens_.fetch_add(n); }
  void add_generation_tokens(int64_t n) { generation_tokens_.fetch_add(n); }
  void observe_step(double seconds, int64_t batch_tokens);
  // The scheduler's own time around a step that ran (admission, batch building, handing tokens to the
  // requests, retiring): the host work between two forward steps, during which a GPU waits.
  void add_scheduler_host_seconds(double seconds);

  // EPLB hooks.
  void set_eplb_balancedness(const std::vector<double>& per_layer, double mean);
  void add_eplb_rebalance(int64_t bytes_migrated);
  // Elastic EP hooks (ranks as processes): live rank processes, and each recovery (fault detected -> first
  // completed step) with the requests it re-prefilled.
  void set_live_ranks(int n);
  void add_elastic_recovery(double seconds);
  void add_reprefilled_requests(int64_t n);

  std::string render(const QueueGauges& gauges) const;

 private:
  mutable std::mutex mutex_;
  std::vector<std::pair<std::string, int64_t>> finished_;  // by finish reason
  std::array<std::atomic<int64_t>, kRejectionReasons.size()> rejected_{};
  std::atomic<int64_t> prompt_tokens_{0};
  std::atomic<int64_t> generation_tokens_{0};
  std::array<int64_t, kStepBuckets.size()> step_buckets_{};
  int64_t step_count_ = 0;
  double step_sum_ = 0;
  double scheduler_host_sum_ = 0;
  int64_t batch_tokens_ = 0;
  std::vector<double> balancedness_;
  double balancedness_mean_ = 0;
  bool has_balancedness_ = false;
  int64_t rebalances_ = 0;
  int64_t bytes_migrated_ = 0;
  int live_ranks_ = 1;
  int64_t recoveries_ = 0;
  double last_recovery_s_ = 0;
  double recovery_s_sum_ = 0;
  int64_t reprefilled_ = 0;
};

}  // namespace fulcrum::server
