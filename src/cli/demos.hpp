#pragma once
// The two demos behind `fulcrum demo`: the model demo (default) and the planning demo (--planning).
#include <string>

namespace fulcrum::cli {

struct DemoFlags {
  bool planning = false;
  std::string loads_file;  // planning demo: instead of the embedded matrix
  std::string heatmap_file = "fulcrum_demo_heatmap.svg";
  int max_new_tokens = 16;  // model demo
};

// Planning table at 8/16/32 GPUs and the before/after heatmap, on the embedded (or given) load matrix.
void run_planning_demo(const DemoFlags& flags);
// A synthetic Qwen3-MoE with real-trace router skew, generated on EP 4 with live EPLB; throws when the
// tokens differ from a run without EPLB.
void run_model_demo(const DemoFlags& flags);

}  // namespace fulcrum::cli
