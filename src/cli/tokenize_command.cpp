// `fulcrum tokenize`: encode text to token ids, or decode ids to text, with a model's tokenizer.json.
#include <memory>
#include <sstream>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/token_ids.hpp"
#include "eplb/error.hpp"
#include "tokenizer/tokenizer.hpp"

namespace fulcrum::cli {
namespace {

struct TokenizeFlags {
  std::string model_dir;
  std::string text;
  std::string decode;
};

void run_tokenize(const TokenizeFlags& flags, bool decode) {
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_file(flags.model_dir);
  if (decode) {
    fmt::print("{}\n", tok.decode(parse_token_ids(flags.decode, "--decode", tok.id_bound())));
  } else {
    fmt::print("{}\n", fmt::join(tok.encode(flags.text), " "));
  }
}

}  // namespace

void register_tokenize_command(CLI::App& app) {
  auto flags = std::make_shared<TokenizeFlags>();
  CLI::App* cmd = app.add_subcommand("tokenize", "Encode text to token ids or decode ids with tokenizer.json");
  cmd->add_option("--model", flags->model_dir, "Folder holding tokenizer.json")->required();
  CLI::Option* text = cmd->add_option("--text", flags->text, "Text to encode; prints the ids, space separated");
  CLI::Option* decode = cmd->add_option("--decode", flags->decode, "Space-separated token ids to decode to text");
  text->excludes(decode);
  cmd->callback([flags, text, decode] {
    FULCRUM_CHECK(text->count() + decode->count() == 1, "tokenize needs --text or --decode");
    run_tokenize(*flags, decode->count() > 0);
  });
}

}  // namespace fulcrum::cli
