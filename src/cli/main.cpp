// fulcrum: command-line entry. Thin: parses flags, calls the library, prints one-line errors.
#include <cstdio>

#include <CLI/CLI.hpp>

#include "cli/commands.hpp"
#include "eplb/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"Fulcrum: Qwen3-MoE serving with an expert-parallel load balancer"};
  app.require_subcommand(1);
  fulcrum::cli::register_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "fulcrum: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fulcrum: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
