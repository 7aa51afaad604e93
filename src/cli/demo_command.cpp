// `fulcrum demo`: the README's main job (the model demo), or with --planning the planning demo.
#include <memory>

#include "cli/commands.hpp"
#include "cli/demos.hpp"

namespace fulcrum::cli {

void register_demo_command(CLI::App& app) {
  auto flags = std::make_shared<DemoFlags>();
  CLI::App* cmd = app.add_subcommand(
      "demo", "Live EPLB on a synthetic Qwen3-MoE with real-trace routing, EP 4 on CPU ranks (no file, no GPU needed)");
  cmd->add_flag("--planning", flags->planning, "Instead: the planning demo on a real Qwen3-30B-A3B load matrix");
  cmd->add_option("--loads", flags->loads_file, "--planning: use this load matrix instead of the embedded one")
      ->check(CLI::ExistingFile);
  cmd->add_option("--heatmap", flags->heatmap_file, "--planning: SVG heatmap output ('' to skip)")->capture_default_str();
  cmd->add_option("--max-new-tokens", flags->max_new_tokens, "Model demo: tokens generated per sequence")
      ->capture_default_str();
  cmd->callback([flags] {
    if (flags->planning) {
      run_planning_demo(*flags);
    } else {
      run_model_demo(*flags);
    }
  });
}

}  // namespace fulcrum::cli
