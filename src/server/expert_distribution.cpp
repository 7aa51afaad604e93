#include "server/expert_distribution.hpp"

#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"

namespace fulcrum::server {

RoutingCountRecorder::RoutingCountRecorder(int num_moe_layers, int num_experts)
    : num_layers_(num_moe_layers), num_experts_(num_experts),
      counts_(static_cast<size_t>(num_moe_layers) * num_experts, 0) {
  FULCRUM_CHECK(num_moe_layers > 0 && num_experts > 0, "expert recorder needs MoE layers and experts, got {} x {}",
                num_moe_layers, num_experts);
}

void RoutingCountRecorder::record(int moe_layer, std::span<const int32_t> expert_ids, int top_k) {
  std::lock_guard lock(mutex_);
  if (!recording_) return;
  FULCRUM_CHECK(moe_layer >= 0 && moe_layer < num_layers_, "MoE layer {} out of range [0, {})", moe_layer, num_layers_);
  if (moe_layer == 0 && top_k > 0) num_tokens_ += static_cast<int64_t>(expert_ids.size()) / top_k;
  int64_t* row = counts_.data() + static_cast<size_t>(moe_layer) * num_experts_;
  for (const int32_t e : expert_ids) {
    FULCRUM_CHECK(e >= 0 && e < num_experts_, "expert id {} out of range [0, {})", e, num_experts_);
    ++row[e];
  }
}

void RoutingCountRecorder::start() {
  std::lock_guard lock(mutex_);
  std::fill(counts_.begin(), counts_.end(), 0);
  num_tokens_ = 0;
  recording_ = true;
}

void RoutingCountRecorder::stop() {
  std::lock_guard lock(mutex_);
  recording_ = false;
}

bool RoutingCountRecorder::recording() const {
  std::lock_guard lock(mutex_);
  return recording_;
}

std::vector<int64_t> RoutingCountRecorder::take_counts() {
  std::lock_guard lock(mutex_);
  std::vector<int64_t> out = counts_;
  out.push_back(num_tokens_);
  std::fill(counts_.begin(), counts_.end(), 0);
  num_tokens_ = 0;
  return out;
}

void RoutingCountRecorder::add_counts(std::span<const int64_t> counts) {
  std::lock_guard lock(mutex_);
  FULCRUM_CHECK(counts.size() == counts_.size() + 1, "routing counts: {} values, expected {}", counts.size(),
                counts_.size() + 1);
  if (!recording_) return;
  for (size_t i = 0; i < counts_.size(); ++i) counts_[i] += counts[i];
  num_tokens_ += counts.back();
}

nlohmann::json RoutingCountRecorder::dump(const std::string& path) {
  nlohmann::json out;
  {
    std::lock_guard lock(mutex_);
    nlohmann::json rows = nlohmann::json::array();
    for (int l = 0; l < num_layers_; ++l) {
      const auto begin = counts_.begin() + static_cast<ptrdiff_t>(l) * num_experts_;
      rows.push_back(std::vector<int64_t>(begin, begin + num_experts_));
    }
    out = {{"logical_count", std::move(rows)}, {"num_tokens", num_tokens_}, {"recording", recording_}};
  }
  if (!path.empty()) write_file_atomically(path, out.dump() + "\n");
  return out;
}

}  // namespace fulcrum::server
