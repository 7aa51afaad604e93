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
void register_serve_command(CLI::App& app);  // also `bench serve`

inline void register_commands(CLI::App& app) {
  register_demo_command(app);
  register_plan_command(app);
  register_simulate_command(app);
  register_generate_command(app);
  register_make_model_command(app);
  register_tokenize_command(app);
  register_serve_command(app);
}

}  // namespace fulcrum::cli
