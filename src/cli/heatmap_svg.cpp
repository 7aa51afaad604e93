#include "cli/heatmap_svg.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace fulcrum::cli {
namespace {

constexpr int kCell = 10;        // pixels per cell
constexpr int kMargin = 40;      // left/top margin for labels
constexpr int kPanelGap = 30;
constexpr int kLegendHeight = 50;

// Blue (under-loaded) -> white (mean) -> red (over-loaded). The distance from the mean is shown on a square-root
// scale so that the few percent left after planning stay visible beside a trivial placement's 3x.
std::string colour(double value, double scale_max) {
  const double v = std::clamp(value, 0.0, scale_max);
  int r = 255, g = 255, b = 255;
  if (v < 1.0) {
    const double t = std::sqrt(1.0 - v);  // 0 at the mean -> 1 at zero load
    r = static_cast<int>(std::lround(255 - 215 * t));
    g = static_cast<int>(std::lround(255 - 165 * t));
  } else {
    const double t = std::sqrt((v - 1.0) / std::max(scale_max - 1.0, 1e-9));  // 0 at the mean -> 1 at scale_max
    g = static_cast<int>(std::lround(255 - 215 * t));
    b = static_cast<int>(std::lround(255 - 215 * t));
  }
  return fmt::format("#{:02x}{:02x}{:02x}", r, g, b);
}

}  // namespace

std::string render_heatmap_svg(const std::string& caption, const std::vector<HeatmapPanel>& panels, double scale_max) {
  int width = kMargin;
  int height = 0;
  for (const auto& p : panels) {
    width += p.num_cols * kCell + kPanelGap;
    height = std::max(height, p.num_rows * kCell);
  }
  height += 2 * kMargin + kLegendHeight;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"16\" font-size=\"13\">{}</text>\n",
      width, height, kMargin, caption);
  int x0 = kMargin;
  for (const auto& p : panels) {
    svg += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", x0, kMargin - 6, p.title);
    for (int r = 0; r < p.num_rows; ++r) {
      for (int c = 0; c < p.num_cols; ++c) {
        const double v = p.values[static_cast<size_t>(r) * p.num_cols + c];
        svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"><title>layer {} GPU {}: "
                           "{:.3f} x mean</title></rect>\n",
                           x0 + c * kCell, kMargin + r * kCell, kCell, kCell, colour(v, scale_max), r, c, v);
      }
    }
    x0 += p.num_cols * kCell + kPanelGap;
  }
  svg += fmt::format("<text x=\"4\" y=\"{}\" transform=\"rotate(-90 12 {})\">MoE layer</text>\n", kMargin + 60,
                     kMargin + 60);
  // Legend: the shared colour scale.
  const int legend_y = height - kLegendHeight + 10;
  const int steps = 50;
  const int legend_width = 300;
  for (int i = 0; i < steps; ++i) {
    const double v = scale_max * i / (steps - 1);
    svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"12\" fill=\"{}\"/>\n",
                       kMargin + i * legend_width / steps, legend_y, legend_width / steps + 1, colour(v, scale_max));
  }
  svg += fmt::format("<text x=\"{}\" y=\"{}\">0</text>\n", kMargin, legend_y + 26);
  svg += fmt::format("<text x=\"{}\" y=\"{}\">1.0 = mean GPU load</text>\n",
                     kMargin + static_cast<int>(legend_width / scale_max) - 20, legend_y + 26);
  svg += fmt::format("<text x=\"{}\" y=\"{}\">&gt;= {:.1f}x</text>\n", kMargin + legend_width - 20, legend_y + 26,
                     scale_max);
  svg += "</svg>\n";
  return svg;
}

}  // namespace fulcrum::cli
