// The CPU half of `bench moe`'s PyTorch peer (src/bench_moe/torch_peer.hpp): the routing handed to the script, the
// script run (stand-in scripts and a stand-in torch, so no torch or GPU is needed), and the ratios in the results.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>

#include "bench_moe/torch_peer.hpp"

namespace fulcrum::bench_moe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kPeerScript = std::string(FULCRUM_SOURCE_DIR) + "/bench/peer/torch_moe_peer.py";

bool have_python3() { return std::system("python3 -c 'pass' >/dev/null 2>&1") == 0; }

class TorchPeerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("fulcrum_torch_peer_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) const {
    const fs::path path = dir_ / name;
    fs::create_directories(path.parent_path());
    std::ofstream(path) << text;
    return path.string();
  }
  fs::path dir_;
};

// Logits drawn as bench_util.cpp logits_for draws them for uniform loads: the chosen experts 4 + U(0,1), the
// others U(-1,1); returns the chosen sets.
std::vector<std::set<int32_t>> draw_logits(int64_t tokens, int experts, int top_k, std::vector<float>& logits) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(0, 1);
  logits.assign(size_t(tokens) * experts, 0);
  std::vector<std::set<int32_t>> chosen(static_cast<size_t>(tokens));
  std::vector<int32_t> all(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int e = 0; e < experts; ++e) logits[t * experts + e] = 2 * u(rng) - 1, all[e] = e;
    std::shuffle(all.begin(), all.end(), rng);
    for (int k = 0; k < top_k; ++k) logits[t * experts + all[k]] = 4 + u(rng), chosen[t].insert(all[k]);
  }
  return chosen;
}

TEST_F(TorchPeerTest, TopkOfLogitsPicksEachTokensDrawnExpertsLargestFirst) {
  const int64_t tokens = 300;
  const int experts = 128, top_k = 8;
  std::vector<float> logits;
  const auto chosen = draw_logits(tokens, experts, top_k, logits);
  const std::vector<int32_t> ids = topk_of_logits(logits, tokens, experts, top_k);
  ASSERT_EQ(ids.size(), size_t(tokens) * top_k);
  for (int64_t t = 0; t < tokens; ++t) {
    const std::set<int32_t> got(ids.begin() + t * top_k, ids.begin() + (t + 1) * top_k);
    EXPECT_EQ(got, chosen[t]) << "token " << t;
    for (int k = 1; k < top_k; ++k) EXPECT_GE(logits[t * experts + ids[t * top_k + k - 1]], logits[t * experts + ids[t * top_k + k]]);
  }
  const std::vector<int32_t> counts = expert_counts_of(ids, experts);
  EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t{0}), tokens * top_k);
  // Ties go to the lower index.
  EXPECT_EQ(topk_of_logits({1, 3, 3, 0}, 1, 4, 2), (std::vector<int32_t>{1, 2}));
  EXPECT_THROW(topk_of_logits({1, 2, 3}, 1, 4, 2), Error);
  EXPECT_THROW(expert_counts_of({0, 4}, 4), Error);
}

// What C++ writes, the script reads back unchanged (its own validation: counts match the ids, no expert twice).
TEST_F(TorchPeerTest, TheScriptReadsTheRoutingFileTheBenchmarkWrites) {
  if (!have_python3()) GTEST_SKIP() << "python3 not found";
  std::vector<float> logits;
  draw_logits(64, 128, 8, logits);
  PeerRouting r{64, topk_of_logits(logits, 64, 128, 8), {}};
  r.expert_counts = expert_counts_of(r.topk_ids, 128);
  const json doc = peer_routing_json({{{"name", "qwen3-30b-a3b"}, {"hidden", 2048}, {"intermediate", 768}}}, {r}, 128, 8);
  const std::string routing = write("routing.json", doc.dump());
  const std::string check = write("check.py",
      "import sys\n"
      "sys.path.insert(0, sys.argv[1])\n"
      "import torch_moe_peer as p\n"
      "models, experts, top_k, routings = p.read_routing(sys.argv[2])\n"
      "t, counts, ids = routings[0]\n"
      "print(models[0][0], models[0][1], models[0][2], experts, top_k, t, sum(counts), len(ids), ids[:3])\n");
  const std::string out = (dir_ / "out.txt").string();
  const std::string cmd = "python3 " + check + " " + fs::path(kPeerScript).parent_path().string() + " " + routing + " >" + out + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << std::ifstream(out).rdbuf();
  std::ostringstream text;
  text << std::ifstream(out).rdbuf();
  EXPECT_EQ(text.str(), fmt::format("qwen3-30b-a3b 2048 768 128 8 64 512 512 [{}, {}, {}]\n", r.topk_ids[0], r.topk_ids[1],
                                    r.topk_ids[2]));
}

TEST_F(TorchPeerTest, ResolveTorchPeerHonoursOffAPathAndAutoWithoutTheScript) {
  std::string note;
  EXPECT_EQ(resolve_torch_peer("off", &note), "");
  EXPECT_EQ(note, "");
  EXPECT_EQ(resolve_torch_peer("my/peer.py", &note), "my/peer.py");
  const fs::path cwd = fs::current_path();
  fs::current_path(dir_);  // no bench/peer here
  const std::string resolved = resolve_torch_peer("auto", &note);
  fs::current_path(cwd);
  EXPECT_EQ(resolved, "");
  EXPECT_NE(note.find("torch peer off: no bench/peer/torch_moe_peer.py"), std::string::npos) << note;
}

TEST_F(TorchPeerTest, RunTorchPeerReturnsTheScriptsResult) {
  if (!have_python3()) GTEST_SKIP() << "python3 not found";
  // A stand-in script: checks the flags the benchmark passes, echoes the routing's batch sizes.
  const std::string script = write("peer ok.py",  // a space: the path is quoted
      "import argparse, json\n"
      "p = argparse.ArgumentParser()\n"
      "for f in ('--routing', '--out'): p.add_argument(f, required=True)\n"
      "p.add_argument('--warmup', type=int, required=True)\n"
      "p.add_argument('--reps', type=int, required=True)\n"
      "a = p.parse_args()\n"
      "doc = json.load(open(a.routing))\n"
      "print('# working')\n"
      "res = [{'model': m['name'], 'tokens': r['tokens'], 'layer_ms': 2.0, 'experts_ms': 1.0}\n"
      "       for m in doc['models'] for r in doc['routing']]\n"
      "json.dump({'torch': 'stand-in', 'warmup': a.warmup, 'reps': a.reps, 'results': res}, open(a.out, 'w'))\n");
  const PeerRouting r{2, {0, 1, 1, 2}, {1, 2, 1}};
  const json peer = run_torch_peer(script, peer_routing_json({{{"name", "m"}, {"hidden", 8}, {"intermediate", 4}}}, {r}, 3, 2), 5, 7);
  ASSERT_FALSE(peer.contains("error")) << peer.dump();
  EXPECT_EQ(peer["torch"], "stand-in");
  EXPECT_EQ(peer["warmup"], 5);
  EXPECT_EQ(peer["reps"], 7);
  ASSERT_EQ(peer["results"].size(), 1u);
  EXPECT_EQ(peer["results"][0]["tokens"], 2);
}

TEST_F(TorchPeerTest, AFailingPeerIsAnErrorLineNeverAThrow) {
  if (!have_python3()) GTEST_SKIP() << "python3 not found";
  const json routing = peer_routing_json({}, {PeerRouting{1, {0}, {1}}}, 1, 1);
  // No such script: python3's own complaint.
  json peer = run_torch_peer((dir_ / "missing.py").string(), routing, 0, 1);
  ASSERT_TRUE(peer.contains("error"));
  EXPECT_NE(peer["error"].get<std::string>().find("missing.py"), std::string::npos) << peer.dump();
  // Exit 0 without a result file, and a result that is not the peer's JSON.
  peer = run_torch_peer(write("silent.py", "print('nothing to say')\n"), routing, 0, 1);
  EXPECT_EQ(peer["error"], "nothing to say");
  peer = run_torch_peer(write("garbled.py", "import sys\nopen(sys.argv[sys.argv.index('--out') + 1], 'w').write('{oops')\n"),
                        routing, 0, 1);
  ASSERT_TRUE(peer.contains("error"));
  EXPECT_NE(peer["error"].get<std::string>().find("parse error"), std::string::npos) << peer.dump();
  peer = run_torch_peer(write("no_results.py", "import sys\nopen(sys.argv[sys.argv.index('--out') + 1], 'w').write('{}')\n"),
                        routing, 0, 1);
  EXPECT_NE(peer["error"].get<std::string>().find("has no 'results' list"), std::string::npos) << peer.dump();
  // The real script on a machine without torch (a stand-in torch package that fails to import, first on the path).
  write("fake/torch/__init__.py", "raise ImportError('stand-in: no torch')\n");
  const char* old = std::getenv("PYTHONPATH");
  const std::string saved = old != nullptr ? old : "";
  setenv("PYTHONPATH", (dir_ / "fake").c_str(), 1);
  peer = run_torch_peer(kPeerScript, routing, 0, 1);
  if (old != nullptr) setenv("PYTHONPATH", saved.c_str(), 1); else unsetenv("PYTHONPATH");
  EXPECT_EQ(peer["error"], "torch_moe_peer: PyTorch is not installed here (import torch: stand-in: no torch)");
}

TEST_F(TorchPeerTest, RatiosGoOnTheUniformRowsThePeerTimed) {
  const auto row = [](const std::string& model, const std::string& scenario, int64_t tokens) {
    return json{{"model", model}, {"scenario", scenario}, {"tokens", tokens}, {"layer_ms_recorder_off", 0.5},
                {"expert_gemm", {{"cutlass", {{"ms", 0.25}}}}}};
  };
  json results = json::array({row("a", "uniform", 256), row("a", "loads_no_eplb", 256), row("a", "uniform", 1024),
                              row("b", "uniform", 256)});
  const json peer = {{"results", json::array({{{"model", "a"}, {"tokens", 256}, {"layer_ms", 2.0}, {"experts_ms", 1.0}},
                                              {{"model", "b"}, {"tokens", 256}, {"layer_ms", nullptr}, {"experts_ms", 1.0}}})}};
  EXPECT_EQ(add_torch_ratios(results, peer), 1);
  EXPECT_DOUBLE_EQ(results[0]["layer_vs_torch"].get<double>(), 4.0);    // 2.0 / 0.5
  EXPECT_DOUBLE_EQ(results[0]["experts_vs_torch"].get<double>(), 4.0);  // 1.0 / 0.25
  EXPECT_FALSE(results[1].contains("layer_vs_torch"));  // not uniform
  EXPECT_FALSE(results[2].contains("layer_vs_torch"));  // the peer has no T=1024 row
  EXPECT_FALSE(results[3].contains("layer_vs_torch"));  // the peer's layer time is missing
  EXPECT_EQ(add_torch_ratios(results, json{{"error", "x"}}), 0);
}

}  // namespace
}  // namespace fulcrum::bench_moe
