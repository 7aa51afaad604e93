#pragma once
// Expert load matrices: how many tokens (or what fraction of them) each logical expert of each MoE
// layer received. Rows are layers, columns logical experts.
#include <span>
#include <string>
#include <vector>

namespace fulcrum::eplb {

struct LoadMatrix {
  int num_layers = 0;
  int num_logical_experts = 0;
  std::vector<double> values;  // [num_layers, num_logical_experts], row-major, finite and >= 0

  LoadMatrix() = default;
  LoadMatrix(int layers, int experts) : num_layers(layers), num_logical_experts(experts),
                                        values(static_cast<size_t>(layers) * experts, 0.0) {}

  std::span<const double> layer(int layer_idx) const {
    return {values.data() + static_cast<size_t>(layer_idx) * num_logical_experts,
            static_cast<size_t>(num_logical_experts)};
  }
  std::span<double> layer(int layer_idx) {
    return {values.data() + static_cast<size_t>(layer_idx) * num_logical_experts,
            static_cast<size_t>(num_logical_experts)};
  }
  double at(int layer_idx, int expert_idx) const {
    return values[static_cast<size_t>(layer_idx) * num_logical_experts + expert_idx];
  }
  double& at(int layer_idx, int expert_idx) {
    return values[static_cast<size_t>(layer_idx) * num_logical_experts + expert_idx];
  }
};

// Parses a CSV load matrix (one row per layer, `#` comment lines, blank lines ignored). `origin` names
// the source in error messages ("file.csv"); errors carry origin:line.
LoadMatrix parse_loads_csv(const std::string& text, const std::string& origin);

// Reads loads from JSON text: `logical_count` as [L][E] (one window) or [S][L][E] (windows summed).
LoadMatrix parse_loads_json(const std::string& text, const std::string& origin);

// Reads the windows of a JSON trace: `logical_count` [S][L][E] gives S windows, [L][E] one.
std::vector<LoadMatrix> parse_load_windows_json(const std::string& text, const std::string& origin);

// Reads a file as CSV or JSON (decided by the first non-blank character: `{` or `[` means JSON).
LoadMatrix read_loads_file(const std::string& path);

// Reads a trace file as a sequence of windows: a JSON [S][L][E] gives S windows, a CSV or [L][E] one.
std::vector<LoadMatrix> read_load_windows_file(const std::string& path);

// Element-wise sum; all matrices must have the same shape (error names the mismatch).
LoadMatrix sum_loads(const std::vector<LoadMatrix>& matrices);

// Reads a whole file into a string; error names the file.
std::string read_text_file(const std::string& path);

}  // namespace fulcrum::eplb
