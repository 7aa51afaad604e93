#include "eplb_runtime/expert_recorder.hpp"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "eplb_runtime/rank_collectives.hpp"

namespace fulcrum::eplb_runtime {

RecorderMode parse_recorder_mode(std::string_view name) {
  if (name == "stat") return RecorderMode::kStat;
  if (name == "per_pass") return RecorderMode::kPerPass;
  if (name == "per_token") return RecorderMode::kPerToken;
  throw Error(fmt::format("unknown expert distribution recorder mode '{}' (known: stat, per_pass, per_token)", name));
}

std::string_view recorder_mode_name(RecorderMode mode) {
  switch (mode) {
    case RecorderMode::kStat: return "stat";
    case RecorderMode::kPerPass: return "per_pass";
    case RecorderMode::kPerToken: return "per_token";
  }
  return "?";
}

ExpertRecorder::ExpertRecorder(RecorderOptions options) : options_(std::move(options)) {
  FULCRUM_CHECK(options_.buffer_size > 0, "recorder buffer size must be positive, got {}", options_.buffer_size);
  FULCRUM_CHECK(options_.num_moe_layers > 0, "recorder needs at least one MoE layer, got {}", options_.num_moe_layers);
  FULCRUM_CHECK(options_.num_logical_experts > 0, "recorder needs at least one logical expert, got {}",
                options_.num_logical_experts);
  FULCRUM_CHECK(options_.top_k >= 0, "recorder top_k must be >= 0, got {}", options_.top_k);
  owned_.assign(static_cast<size_t>(options_.num_moe_layers), options_.owned_moe_layers.empty() ? 1 : 0);
  for (const int moe_layer_idx : options_.owned_moe_layers) {
    FULCRUM_CHECK(moe_layer_idx >= 0 && moe_layer_idx < options_.num_moe_layers,
                  "recorder: owned MoE layer {} outside [0, {})", moe_layer_idx, options_.num_moe_layers);
    owned_[static_cast<size_t>(moe_layer_idx)] = 1;
  }
  current_.assign(layer_stride(), 0);
  ring_.assign(layer_stride() * static_cast<size_t>(options_.buffer_size), 0);
  if (options_.mode == RecorderMode::kPerToken) {
    current_ids_.assign(static_cast<size_t>(options_.num_moe_layers), {});
    ring_ids_.assign(static_cast<size_t>(options_.buffer_size), {});
  }
}

bool ExpertRecorder::owns_layer(int moe_layer_idx) const {
  return moe_layer_idx >= 0 && moe_layer_idx < options_.num_moe_layers && owned_[static_cast<size_t>(moe_layer_idx)];
}

void ExpertRecorder::record(int moe_layer_idx, std::span<const int32_t> logical_expert_ids) {
  FULCRUM_CHECK(owns_layer(moe_layer_idx), "recorder: MoE layer {} is not owned by this rank (of {} MoE layers)",
                moe_layer_idx, options_.num_moe_layers);
  const int32_t num_experts = options_.num_logical_experts;
  int32_t* counts = current_.data() + static_cast<size_t>(moe_layer_idx) * static_cast<size_t>(num_experts);
  for (const int32_t expert_idx : logical_expert_ids) {
    if (static_cast<uint32_t>(expert_idx) < static_cast<uint32_t>(num_experts)) {
      ++counts[expert_idx];
    } else {
      FULCRUM_CHECK(expert_idx == -1, "recorder: MoE layer {}: logical expert {} outside [0, {}) (-1 marks padding)",
                    moe_layer_idx, expert_idx, num_experts);
    }
  }
  if (options_.mode == RecorderMode::kPerToken) {
    auto& ids = current_ids_[static_cast<size_t>(moe_layer_idx)];
    ids.insert(ids.end(), logical_expert_ids.begin(), logical_expert_ids.end());
  }
}

void ExpertRecorder::end_pass() {
  std::copy(current_.begin(), current_.end(), pass_counts(next_ring_idx_));
  std::fill(current_.begin(), current_.end(), 0);
  if (options_.mode == RecorderMode::kPerToken) {
    ring_ids_[static_cast<size_t>(next_ring_idx_)] = std::move(current_ids_);
    current_ids_.assign(static_cast<size_t>(options_.num_moe_layers), {});
  }
  next_ring_idx_ = (next_ring_idx_ + 1) % options_.buffer_size;
  num_in_window_ = std::min(num_in_window_ + 1, options_.buffer_size);
  ++num_passes_total_;
}

void ExpertRecorder::reset() {
  std::fill(current_.begin(), current_.end(), 0);
  std::fill(ring_.begin(), ring_.end(), 0);
  if (options_.mode == RecorderMode::kPerToken) {
    current_ids_.assign(static_cast<size_t>(options_.num_moe_layers), {});
    ring_ids_.assign(static_cast<size_t>(options_.buffer_size), {});
  }
  next_ring_idx_ = 0;
  num_in_window_ = 0;
  num_passes_total_ = 0;
}

int ExpertRecorder::ring_index(int age) const {
  const int oldest = (next_ring_idx_ - num_in_window_ + options_.buffer_size) % options_.buffer_size;
  return (oldest + age) % options_.buffer_size;
}

eplb::LoadMatrix ExpertRecorder::window_loads() const {
  eplb::LoadMatrix loads(options_.num_moe_layers, options_.num_logical_experts);
  std::vector<int64_t> sum(layer_stride(), 0);
  for (int age = 0; age < num_in_window_; ++age) {
    const int32_t* counts = pass_counts(ring_index(age));
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += counts[i];
  }
  for (size_t i = 0; i < sum.size(); ++i) loads.values[i] = static_cast<double>(sum[i]);
  return loads;
}

std::vector<eplb::LoadMatrix> ExpertRecorder::pass_loads() const {
  std::vector<eplb::LoadMatrix> passes;
  for (int age = 0; age < num_in_window_; ++age) {
    eplb::LoadMatrix loads(options_.num_moe_layers, options_.num_logical_experts);
    const int32_t* counts = pass_counts(ring_index(age));
    for (size_t i = 0; i < layer_stride(); ++i) loads.values[i] = counts[i];
    passes.push_back(std::move(loads));
  }
  return passes;
}

std::vector<std::vector<std::vector<int32_t>>> ExpertRecorder::pass_token_expert_ids() const {
  FULCRUM_CHECK(options_.mode == RecorderMode::kPerToken, "recorder: raw ids are kept only in per_token mode (mode is {})",
                recorder_mode_name(options_.mode));
  std::vector<std::vector<std::vector<int32_t>>> passes;
  for (int age = 0; age < num_in_window_; ++age) passes.push_back(ring_ids_[static_cast<size_t>(ring_index(age))]);
  return passes;
}

void ExpertRecorder::merge_across_ranks(comm::Communicator& comm) {
  // Shape and window length must agree: a disagreement would silently mix different passes.
  const std::vector<int64_t> shape = {static_cast<int64_t>(options_.mode), options_.buffer_size,
                                      options_.num_moe_layers, options_.num_logical_experts, num_in_window_};
  const std::vector<int64_t> shapes = all_gather_int64(comm, shape);
  for (int r = 0; r < comm.size(); ++r) {
    for (size_t i = 0; i < shape.size(); ++i) {
      FULCRUM_CHECK(shapes[static_cast<size_t>(r) * shape.size() + i] == shape[i],
                    "recorder merge: rank {} has (mode, buffer, layers, experts, passes) differing from rank {} at field {}",
                    r, comm.rank(), i);
    }
  }
  // Window in age order, as int64 so the sum is exact.
  std::vector<int64_t> window(layer_stride() * static_cast<size_t>(num_in_window_));
  for (int age = 0; age < num_in_window_; ++age) {
    const int32_t* counts = pass_counts(ring_index(age));
    std::copy(counts, counts + layer_stride(), window.begin() + static_cast<std::ptrdiff_t>(age * layer_stride()));
  }
  const std::vector<int64_t> merged = all_reduce_sum_int64(comm, window);
  std::vector<std::vector<std::vector<int32_t>>> merged_ids;
  if (options_.mode == RecorderMode::kPerToken) {
    for (int age = 0; age < num_in_window_; ++age) {
      merged_ids.emplace_back();
      for (const auto& ids : ring_ids_[static_cast<size_t>(ring_index(age))]) {
        merged_ids.back().push_back(all_gather_v_int32(comm, ids));
      }
    }
  }
  // Re-lay the window from ring slot 0 (the current pass is left as it is).
  for (int age = 0; age < num_in_window_; ++age) {
    int32_t* counts = pass_counts(age);
    for (size_t i = 0; i < layer_stride(); ++i) {
      const int64_t value = merged[static_cast<size_t>(age) * layer_stride() + i];
      FULCRUM_CHECK(value <= INT32_MAX, "recorder merge: a pass count exceeds int32 ({})", value);
      counts[i] = static_cast<int32_t>(value);
    }
    if (options_.mode == RecorderMode::kPerToken) ring_ids_[static_cast<size_t>(age)] = std::move(merged_ids[age]);
  }
  next_ring_idx_ = num_in_window_ % options_.buffer_size;
}

nlohmann::json ExpertRecorder::to_json() const {
  nlohmann::json doc;
  doc["mode"] = std::string(recorder_mode_name(options_.mode));
  doc["buffer_size"] = options_.buffer_size;
  doc["num_passes"] = num_in_window_;
  doc["num_passes_total"] = num_passes_total_;
  doc["num_moe_layers"] = options_.num_moe_layers;
  doc["num_logical_experts"] = options_.num_logical_experts;
  auto matrix_json = [&](const eplb::LoadMatrix& loads) {
    nlohmann::json rows = nlohmann::json::array();
    for (int layer_idx = 0; layer_idx < loads.num_layers; ++layer_idx) {
      nlohmann::json row = nlohmann::json::array();
      for (const double v : loads.layer(layer_idx)) row.push_back(static_cast<int64_t>(v));
      rows.push_back(std::move(row));
    }
    return rows;
  };
  if (options_.mode == RecorderMode::kStat) {
    doc["logical_count"] = matrix_json(window_loads());
    return doc;
  }
  // [S][L][E]; `fulcrum plan` rejects an empty list, so an empty window is one all-zero pass.
  nlohmann::json windows = nlohmann::json::array();
  for (const auto& loads : pass_loads()) windows.push_back(matrix_json(loads));
  if (windows.empty()) windows.push_back(matrix_json(eplb::LoadMatrix(options_.num_moe_layers, options_.num_logical_experts)));
  doc["logical_count"] = std::move(windows);
  if (options_.mode == RecorderMode::kPerToken) {
    doc["top_k"] = options_.top_k;
    doc["per_token_expert_ids"] = pass_token_expert_ids();  // [S][L][num_tokens * top_k]
  }
  return doc;
}

void ExpertRecorder::dump(const std::string& path) const { write_file_atomically(path, to_json().dump() + "\n"); }

eplb::LoadMatrix all_reduce_window_loads(const ExpertRecorder& recorder, comm::Communicator& comm) {
  const eplb::LoadMatrix local = recorder.window_loads();
  std::vector<int64_t> counts(local.values.size());
  for (size_t i = 0; i < counts.size(); ++i) counts[i] = static_cast<int64_t>(local.values[i]);
  const std::vector<int64_t> sum = all_reduce_sum_int64(comm, counts);
  eplb::LoadMatrix merged(local.num_layers, local.num_logical_experts);
  for (size_t i = 0; i < sum.size(); ++i) merged.values[i] = static_cast<double>(sum[i]);
  return merged;
}

}  // namespace fulcrum::eplb_runtime
