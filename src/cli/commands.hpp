#pragma once
// Subcommands of the fulcrum CLI; each file registers one.
#include <string>

#include <CLI/CLI.hpp>

namespace fulcrum::cli {

// The command line as the user typed it (main sets it; benchmarks record it in their results).
inline std::string& command_line() {
  static std::string line;
  return line;
}

void register_plan_command(CLI::App& app);
void register_simulate_command(CLI::App& app);
void register_demo_command(CLI::App& app);
void register_generate_command(CLI::App& app);
void register_make_model_command(CLI::App& app);
void register_tokenize_command(CLI::App& app);
void register_bench_command(CLI::App& app);  // `bench moe`, and `bench serve` with the server
#ifdef FULCRUM_WITH_SERVER
void register_serve_command(CLI::App& app);
void register_bench_serve_command(CLI::App& bench);
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
  register_bench_command(app);
}

}  // namespace fulcrum::cli
