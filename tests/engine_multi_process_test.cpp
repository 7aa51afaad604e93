// `fulcrum generate` with ranks as processes (--device cpu, TCP between them): one command on one node,
// and 2 nodes x 1 rank started as two commands on this host, print the one-rank tokens; a rank that fails
// stops the others (no process left behind) with one error line; bad launch flags are one-line errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "comm/tcp_socket.hpp"
#include "engine_test_util.hpp"
#include "process_list.hpp"

namespace fulcrum::test {
namespace {

const std::string kPrompts = " --prompt-tokens '3 17 250 9 41' --prompt-tokens '200' --prompt-tokens '0 8 99'";

std::string base_command() {
  return "generate --model " + golden_model_dir(k128e) + " --max-new-tokens 5" + kPrompts;
}


TEST(MultiProcessGenerate, OneNodeAndTwoNodesPrintTheOneRankTokens) {
  TempDir dir("multi_process");
  const CliRun one = run_cli(dir, base_command());
  ASSERT_EQ(one.exit_code, 0) << one.err;
  ASSERT_FALSE(tokens_of(one.out).empty());

  const CliRun local = run_cli(dir, base_command() + " --tp 2 --ep 2 --multi-process");
  ASSERT_EQ(local.exit_code, 0) << local.err;
  EXPECT_EQ(tokens_of(local.out), tokens_of(one.out));
  EXPECT_NE(local.out.find("on cpu x 2 process ranks"), std::string::npos) << local.out;

  // Two nodes of one rank each.
  const std::string addr = "127.0.0.1:" + std::to_string(comm::pick_free_port());
  const auto [node0, node1] = run_cli_two_nodes(dir, base_command() + " --tp 2 --ep 2 --nnodes 2 --dist-init-addr " + addr);
  EXPECT_EQ(node0.exit_code, 0) << node0.err;
  EXPECT_EQ(node1.exit_code, 0) << node1.err;
  EXPECT_EQ(tokens_of(node0.out), tokens_of(one.out));
  EXPECT_EQ(node1.out, "");  // world rank 0 (node 0) prints
}

TEST(MultiProcessGenerate, AFailingRankStopsTheOthersWithOneErrorLine) {
  TempDir dir("multi_process");
  // Rank 1 finds a corrupt weight cache and fails; rank 0 would wait for it forever.
  std::filesystem::create_directories(dir.file("cache"));
  std::ofstream(dir.file("cache/rank1.safetensors")) << "not a safetensors file";
  const CliRun run = run_cli(dir, base_command() + " --tp 2 --ep 2 --multi-process --weight-cache " + dir.file("cache"));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.err.rfind("fulcrum: error: rank 1: ", 0), 0u) << run.err;
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  EXPECT_NE(run.err.find("rank1.safetensors"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("exited with status 1"), std::string::npos) << run.err;
  EXPECT_EQ(run.out.find("seq0:"), std::string::npos);
  EXPECT_EQ(processes_mentioning(dir.path()), 0);  // no rank left behind
}

TEST(MultiProcessGenerate, BadLaunchFlagsAreOneLineErrors) {
  TempDir dir("multi_process");
  const std::string free_addr = "127.0.0.1:" + std::to_string(comm::pick_free_port());  // nobody serves there
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --tp 2 --ep 2 --nnodes 2", "--nnodes 2 needs --dist-init-addr HOST:PORT"},
      {" --tp 2 --ep 2 --nnodes 3 --dist-init-addr " + free_addr, "the layout's 2 ranks do not divide evenly over --nnodes 3"},
      {" --tp 2 --ep 2 --nnodes 2 --node-rank 2 --dist-init-addr " + free_addr, "--node-rank 2 outside [0, --nnodes 2)"},
      {" --tp 2 --ep 2 --nnodes 2 --dist-init-addr nohost", "--dist-init-addr: expected HOST:PORT, got 'nohost'"},
      // node 1 alone: rank 0 never comes
      {" --tp 2 --ep 2 --nnodes 2 --node-rank 1 --dist-timeout 1 --dist-init-addr " + free_addr,
       "cannot connect to " + free_addr},
  };
  for (const auto& [flags, needle] : cases) {
    const CliRun run = run_cli(dir, base_command() + flags);
    EXPECT_EQ(run.exit_code, 1) << flags;
    EXPECT_EQ(run.err.rfind("fulcrum: error: ", 0), 0u) << run.err;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
    EXPECT_NE(run.err.find(needle), std::string::npos) << flags << "\n" << run.err;
  }
}

}  // namespace
}  // namespace fulcrum::test
