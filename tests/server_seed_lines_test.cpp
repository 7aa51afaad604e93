// The seeds' SGLang launch lines (../shared/seeds), pasted into `fulcrum serve` as they are, a local model folder
// in place of the hub name: each starts with SGLang's meaning of its flags (the layout it logs, the notes saying
// what runs) and answers a completion with the tokens of a one-rank `fulcrum generate`.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "server_http_util.hpp"
#include "server_process.hpp"
#include "server_test_util.hpp"

namespace fulcrum::test {
namespace {

// The distinct argument lists after "sglang.launch_server" in the seed files, in file and line order.
std::vector<std::vector<std::string>> seed_launch_lines() {
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(shared_path("seeds"))) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::vector<std::vector<std::string>> lines;
  std::set<std::string> seen;
  for (const auto& file : files) {
    std::ifstream in(file);
    for (std::string line; std::getline(in, line);) {
      const size_t at = line.find("sglang.launch_server ");
      if (at == std::string::npos) continue;
      const std::string args = line.substr(at + std::string("sglang.launch_server ").size());
      if (!seen.insert(args).second) continue;
      std::istringstream words(args);
      lines.emplace_back();
      for (std::string w; words >> w;) lines.back().push_back(w);
    }
  }
  return lines;
}

// `args` with the value of --model-path / --model (a hub name) replaced by `dir`.
std::vector<std::string> with_local_model(std::vector<std::string> args, const std::string& dir) {
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--model-path" || args[i] == "--model") args[i + 1] = dir;
  }
  return args;
}

const std::vector<int32_t> kPrompt = {3, 17, 250, 9, 41, 7};

// Starts `fulcrum serve ARGS` (no --model added), checks the log holds every needle, and that a greedy
// completion equals the one-rank `fulcrum generate`.
void expect_serves(const std::vector<std::string>& args, const std::vector<std::string>& needles) {
  TempDir dir("serve_seed_line");
  ServerProcess server("", args, dir.file("serve.log"));
  for (const std::string& needle : needles) EXPECT_NE(server.log().find(needle), std::string::npos) << needle << "\n" << server.log();
  const json body = {{"prompt", kPrompt}, {"max_tokens", 6}, {"ignore_eos", true}};
  const auto [status, out] = post(server.port(), "/v1/completions", body.dump());
  ASSERT_EQ(status, 200) << out.dump();
  EXPECT_EQ(out["choices"][0]["token_ids"].get<std::vector<int32_t>>(),
            generate_greedy(tiny_served_model(), "", {kPrompt}, 6)[0]);
  EXPECT_EQ(server.terminate(), 0) << server.log();
}

TEST(ServerSeedLines, TheSeedsLaunchLinesServeWithSglangsMeaning) {
  const auto lines = seed_launch_lines();
  ASSERT_EQ(lines.size(), 2u);  // the EPLB launch and the pipeline-parallel report (twice in the thread)
  ASSERT_EQ(lines[0][0], "--model-path");
  // --tp 8 --dp 2 --enable-dp-attention: 8 ranks in 2 attention groups of 4; --enable-deepep-moe: alltoall, and
  // --ep defaults to --tp; 128 experts + 32 redundant slots; EPLB on.
  expect_serves(with_local_model(lines[0], tiny_served_model()),
                {"tp 8 (attention: 2 DP group(s) x 4 TP), ep 8 (1 rank(s) per EP rank), pp 1: [0,2), 160 slots per MoE "
                 "layer, EPLB on",
                 "fulcrum: note: --enable-deepep-moe runs Fulcrum's alltoall dispatch (each token only to the ranks "
                 "holding its chosen replica); --ep defaults to --tp as in SGLang: --ep 8",
                 "fulcrum: note: --deepep-mode normal: alltoall has one mode",
                 "fulcrum: note: --trust-remote-code: no code from the checkpoint runs",
                 "prefix cache off (--disable-radix-cache)"});
  ASSERT_EQ(lines[1], (std::vector<std::string>{"--model", "Qwen/Qwen3-30B-A3B", "--pp", "2"}));
  expect_serves(with_local_model(lines[1], tiny_served_model()), {"tp 1 (attention: 1 DP group(s) x 1 TP), ep 1 "
                                                                  "(1 rank(s) per EP rank), pp 2: [0,1) [1,2)"});
}

// The Mooncake seed (002) reports its launch as settings, not a line: TP 8, DP 8, EP 8, --moe-a2a-backend
// mooncake, --enable-eplb (its --elastic-ep-backend, rank-failure recovery, has no counterpart and stays an error).
TEST(ServerSeedLines, TheMooncakeSeedsSettingsServeOnAlltoall) {
  const std::string model = tiny_served_model();
  expect_serves({"--model-path", model, "--tp", "8", "--dp", "8", "--ep", "8", "--enable-dp-attention",
                 "--moe-a2a-backend", "mooncake", "--enable-eplb"},
                {"tp 8 (attention: 8 DP group(s) x 1 TP), ep 8 (1 rank(s) per EP rank), pp 1: [0,2), 128 slots",
                 "fulcrum: note: --moe-a2a-backend mooncake runs Fulcrum's alltoall dispatch"});
  TempDir dir("serve_seed_line");
  const CliRun elastic = run_cli(dir, "serve --model-path " + model + " --elastic-ep-backend mooncake");
  EXPECT_EQ(elastic.exit_code, 2);
  EXPECT_EQ(std::count(elastic.err.begin(), elastic.err.end(), '\n'), 1) << elastic.err;
  EXPECT_NE(elastic.err.find("not expected: "), std::string::npos) << elastic.err;
  EXPECT_NE(elastic.err.find("--elastic-ep-backend"), std::string::npos) << elastic.err;
}

}  // namespace
}  // namespace fulcrum::test
