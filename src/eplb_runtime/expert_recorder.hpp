#pragma once
// Expert distribution recorder: counts, per forward pass, how many routing choices each (MoE layer,
// logical expert) received, and keeps the last `buffer_size` passes in a ring (the window).
//
// Modes (--expert-distribution-recorder-mode):
//   stat       window_loads() = counts summed over the window; the dump writes logical_count [L][E].
//   per_pass   the same counts, and the dump writes each pass of the window: logical_count [S][L][E].
//   per_token  per_pass, plus each pass's raw choices per layer (dump key "per_token_expert_ids").
//
// Counting contract (a CUDA recorder must match it):
//   * record(moe_layer_idx, ids) adds 1 to counts[moe_layer_idx][id] for every id in [0, E); id -1 marks
//     a padded / dropped token and is skipped; any other id is an error. Several calls for the same
//     layer in one pass add up (micro-batches). Per token this is one histogram increment, nothing else
//     (a device version is one atomicAdd into an int32 [L][E] histogram of the current pass).
//   * end_pass() closes the pass: O(L*E) host work (the device version copies the histogram into ring
//     slot `pass % buffer_size` and zeroes it). Counts of a pass that is never closed are not in the window.
//   * Only the MoE layers this rank/stage owns may be recorded; the others stay zero, so window loads and
//     dumps always cover the whole model's MoE layers [num_moe_layers][num_logical_experts].
//   * Ranks that route distinct tokens (attention-DP ranks, pipeline stages) each record their own;
//     ranks that route the same tokens (tensor parallel) must let only one of them record.
//     merge_across_ranks / all_reduce_window_loads sum exactly (int64) and identically on every rank.
// Memory: buffer_size * L * E * 4 bytes for the ring, plus the raw ids in per_token mode.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "comm/communicator.hpp"
#include "eplb/loads.hpp"

namespace fulcrum::eplb_runtime {

enum class RecorderMode { kStat, kPerPass, kPerToken };

// "stat", "per_pass", "per_token"; anything else throws fulcrum::Error listing these.
RecorderMode parse_recorder_mode(std::string_view name);
std::string_view recorder_mode_name(RecorderMode mode);

struct RecorderOptions {
  RecorderMode mode = RecorderMode::kStat;
  int buffer_size = 1000;             // passes in the window (--expert-distribution-recorder-buffer-size)
  int num_moe_layers = 0;             // of the whole model
  int num_logical_experts = 0;
  std::vector<int> owned_moe_layers;  // MoE layers this rank records; empty: all of them
  int top_k = 0;                      // written to per_token dumps (choices per token); 0: unknown
};

class ExpertRecorder {
 public:
  explicit ExpertRecorder(RecorderOptions options);

  const RecorderOptions& options() const { return options_; }
  bool owns_layer(int moe_layer_idx) const;

  // One layer of the current pass: every token's chosen logical experts, flattened.
  void record(int moe_layer_idx, std::span<const int32_t> logical_expert_ids);
  // Closes the current pass and pushes it into the window (evicting the oldest when full).
  void end_pass();
  // Forgets every pass (window and current).
  void reset();

  int num_passes_in_window() const { return num_in_window_; }
  int64_t num_passes_total() const { return num_passes_total_; }

  // Counts summed over the window: [num_moe_layers][num_logical_experts].
  eplb::LoadMatrix window_loads() const;
  // Each pass of the window, oldest first (every mode keeps them).
  std::vector<eplb::LoadMatrix> pass_loads() const;
  // per_token mode: the window's raw ids, oldest pass first: [pass][moe_layer] -> flattened ids.
  std::vector<std::vector<std::vector<int32_t>>> pass_token_expert_ids() const;

  // Collective over `comm`: replaces this rank's window by the sum over ranks (counts, exact) and, in
  // per_token mode, the rank-order concatenation of the raw ids. Every rank must hold the same number
  // of passes in its window and use the same options (checked). Afterwards every rank holds the same window.
  void merge_across_ranks(comm::Communicator& comm);

  // The dump `fulcrum plan` reads (see the header comment for the keys per mode).
  nlohmann::json to_json() const;
  // Writes to_json() atomically (temporary file + rename).
  void dump(const std::string& path) const;

 private:
  int ring_index(int age) const;  // age 0: oldest pass of the window
  int32_t* pass_counts(int ring_idx) { return ring_.data() + static_cast<size_t>(ring_idx) * layer_stride(); }
  const int32_t* pass_counts(int ring_idx) const { return ring_.data() + static_cast<size_t>(ring_idx) * layer_stride(); }
  size_t layer_stride() const {
    return static_cast<size_t>(options_.num_moe_layers) * static_cast<size_t>(options_.num_logical_experts);
  }

  RecorderOptions options_;
  std::vector<char> owned_;                   // [num_moe_layers]
  std::vector<int32_t> current_;              // [L * E] counts of the open pass
  std::vector<std::vector<int32_t>> current_ids_;  // per_token: [L] raw ids of the open pass
  std::vector<int32_t> ring_;                 // [buffer_size][L * E]
  std::vector<std::vector<std::vector<int32_t>>> ring_ids_;  // per_token: [buffer_size][L] raw ids
  int next_ring_idx_ = 0;
  int num_in_window_ = 0;
  int64_t num_passes_total_ = 0;
};

// Collective: the window loads summed over the ranks of `comm` (exact int64 sums, identical on every
// rank) without changing the recorder. What a manager plans on.
eplb::LoadMatrix all_reduce_window_loads(const ExpertRecorder& recorder, comm::Communicator& comm);

}  // namespace fulcrum::eplb_runtime
