#pragma once
// Heatmap pictures of per-GPU load (rows = MoE layers, columns = GPUs), as standalone SVG.
#include <string>
#include <vector>

namespace fulcrum::cli {

struct HeatmapPanel {
  std::string title;
  int num_rows = 0;
  int num_cols = 0;
  std::vector<double> values;  // [num_rows, num_cols]: load relative to the row mean (1.0 = perfect)
};

// Panels side by side with one shared colour scale from 0 to `scale_max` (values above are clipped).
std::string render_heatmap_svg(const std::string& caption, const std::vector<HeatmapPanel>& panels, double scale_max);

}  // namespace fulcrum::cli
