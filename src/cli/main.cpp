// fulcrum: command-line entry. Thin: parses flags, calls the library, prints one-line errors.
#include <cstdio>
#include <string>
#include <utility>

#include <CLI/CLI.hpp>

#include "cli/commands.hpp"
#include "eplb/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"Fulcrum: Qwen3-MoE serving with an expert-parallel load balancer"};
  app.require_subcommand(1);
  fulcrum::cli::register_commands(app);
  for (int i = 0; i < argc; ++i) fulcrum::cli::command_line() += (i == 0 ? "fulcrum" : std::string(" ") + argv[i]);
  try {
    // CLI11 reports an unknown subcommand as a missing one; name it instead.
    std::string known;
    bool is_known = false;
    const auto all = std::as_const(app).get_subcommands([](const CLI::App*) { return true; });
    for (const CLI::App* sub : all) {
      known += (known.empty() ? "" : ", ") + sub->get_name();
      is_known = is_known || (argc > 1 && sub->get_name() == argv[1]);
    }
    if (argc > 1 && argv[1][0] != '-' && !is_known) {
      std::fprintf(stderr, "fulcrum: error: unknown command '%s' (known: %s)\n", argv[1], known.c_str());
      return 2;
    }
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
