#pragma once
// Expert-distribution recording behind the /start_, /stop_ and /dump_expert_distribution_record
// endpoints. The single-rank executor counts routing decisions itself (RoutingCountRecorder); the EPLB
// runtime, which already records per rank, implements ExpertDistributionRecorder over its own recorder.
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fulcrum::server {

class ExpertDistributionRecorder {
 public:
  virtual ~ExpertDistributionRecorder() = default;
  // Clears the counts and starts counting.
  virtual void start() = 0;
  // Stops counting; the counts are kept for dump().
  virtual void stop() = 0;
  virtual bool recording() const = 0;
  // {"logical_count": [L][E]} (counts since the last start, what `fulcrum plan --loads` reads), plus
  // "num_tokens" and "recording". Written atomically to `path` when it is not empty.
  virtual nlohmann::json dump(const std::string& path) = 0;
};

// Counts, per (MoE layer ordinal, logical expert), how many top-k slots chose the expert. Thread-safe.
class RoutingCountRecorder final : public ExpertDistributionRecorder {
 public:
  RoutingCountRecorder(int num_moe_layers, int num_experts);

  // One MoE layer of one step: `expert_ids` [num_tokens * top_k] logical ids. Ignored unless recording.
  void record(int moe_layer, std::span<const int32_t> expert_ids, int top_k);

  void start() override;
  void stop() override;
  bool recording() const override;
  nlohmann::json dump(const std::string& path) override;

  // Ranks as processes: a worker rank's counts since its last take ([num_layers * num_experts], then
  // num_tokens), zeroed; world rank 0 adds them to its own (ignored unless recording).
  std::vector<int64_t> take_counts();
  size_t num_values() const { return counts_.size() + 1; }
  void add_counts(std::span<const int64_t> counts);

 private:
  mutable std::mutex mutex_;
  int num_layers_;
  int num_experts_;
  bool recording_ = false;
  int64_t num_tokens_ = 0;        // tokens seen by MoE layer 0 while recording
  std::vector<int64_t> counts_;  // [num_layers, num_experts]
};

}  // namespace fulcrum::server
