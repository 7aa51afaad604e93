#pragma once
// Subcommands of the fulcrum CLI; each file registers one.
#include <CLI/CLI.hpp>

namespace fulcrum::cli {

void register_plan_command(CLI::App& app);
void register_simulate_command(CLI::App& app);
void register_demo_command(CLI::App& app);
void register_generate_command(CLI::App& app);
void register_make_model_command(CLI::App& app);
void register_tokenize_command(CLI::App& app);
#ifdef FULCRUM_WITH_SERVER
void register_serve_command(CLI::App& app);  // also `bench serve` (built with FULCRUM_BUILD_SERVER)
#endif

inline void register_commands(CLI::App& app) {
  register_demo_command(app);
  register_plan_command(app);
  register_simulate_command(app);
  register_generate_command(app);
  register_make_model_command(app);
  register_tokenize_command(app);
#ifdef FULCRUM_WITH_SERVER
  register_serve_command(app);
#endif
}

}  // namespace fulcrum::cli
