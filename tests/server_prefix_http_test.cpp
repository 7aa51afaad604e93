// Prefix caching through real `fulcrum serve` processes: on by default, off with --disable-radix-cache,
// the same tokens either way for prompts sharing a prefix; its /metrics counters; POST /flush_cache; and
// `bench serve --shared-prefix` against it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "server_http_util.hpp"
#include "server_process.hpp"
#include "server_test_util.hpp"

namespace fulcrum::test {
namespace {

using nlohmann::json;

// Prompts of one 40-token prefix and short suffixes, sent one after another (each finds the last cached).
std::vector<std::vector<int32_t>> completions(int port) {
  std::vector<int32_t> prefix;
  for (int i = 0; i < 40; ++i) prefix.push_back(3 + (i * 7) % 200);
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < 5; ++i) {
    std::vector<int32_t> prompt = prefix;
    for (int j = 0; j <= i; ++j) prompt.push_back(10 + i + j);
    const auto [status, body] =
        post(port, "/v1/completions", json{{"prompt", prompt}, {"max_tokens", 6}, {"ignore_eos", true}}.dump());
    EXPECT_EQ(status, 200) << body.dump();
    out.push_back(body.at("choices").at(0).at("token_ids").get<std::vector<int32_t>>());
  }
  return out;
}

TEST(ServerPrefixHttp, CacheOnAndOffGiveTheSameTokensAndFlushEmptiesIt) {
  std::signal(SIGPIPE, SIG_IGN);
  TempDir dir("serve_prefix");
  const std::vector<std::string> flags = {"--kv-pages", "64", "--page-size", "8", "--max-prefill-tokens", "16"};
  ServerProcess on(tiny_served_model(), flags, dir.file("on.log"));
  std::vector<std::string> off_flags = flags;
  off_flags.push_back("--disable-radix-cache");
  ServerProcess off(tiny_served_model(), off_flags, dir.file("off.log"));

  EXPECT_EQ(completions(on.port()), completions(off.port()));
  std::map<std::string, double> m = metrics(on.port());
  EXPECT_EQ(m.at("fulcrum_prefix_cache_enabled"), 1);
  EXPECT_EQ(m.at("fulcrum_prefix_cache_hit_tokens_total"), 4 * 40);  // 5 whole pages, each of the last 4 prompts
  EXPECT_GT(m.at("fulcrum_prefix_cache_hit_ratio"), 0.5);
  EXPECT_LE(m.at("fulcrum_prefix_cache_hit_ratio"), 1.0);
  EXPECT_GT(m.at("fulcrum_prefix_cache_pages"), 0);
  EXPECT_EQ(m.at("fulcrum_prefix_cache_evicted_pages_total"), 0);
  EXPECT_EQ(m.at("fulcrum_kv_pages_used"), 0);
  const std::map<std::string, double> m_off = metrics(off.port());
  EXPECT_EQ(m_off.at("fulcrum_prefix_cache_enabled"), 0);
  EXPECT_EQ(m_off.at("fulcrum_prefix_cache_hit_tokens_total"), 0);
  EXPECT_EQ(m_off.at("fulcrum_prefix_cache_pages"), 0);
  // Prompt tokens count cached and computed ones alike.
  EXPECT_EQ(m.at("fulcrum_prompt_tokens_total"), m_off.at("fulcrum_prompt_tokens_total"));

  const auto [status, flushed] = post(on.port(), "/flush_cache", "");
  EXPECT_EQ(status, 200);
  EXPECT_EQ(flushed.at("flushed_pages"), m.at("fulcrum_prefix_cache_pages")) << flushed.dump();
  EXPECT_EQ(flushed.at("in_use_pages"), 0);
  EXPECT_EQ(metrics(on.port()).at("fulcrum_prefix_cache_pages"), 0);
  const auto [off_status, off_flushed] = post(off.port(), "/flush_cache", "");
  EXPECT_EQ(off_status, 200);
  EXPECT_EQ(off_flushed.at("flushed_pages"), 0);

  // The load generator's shared-prefix workload reports the server's hits.
  const CliRun bench = run_cli(dir, fmt::format("bench serve --url {} --clients 3 --requests 9 --shared-prefix 24 "
                                                "--prompt-len 2:6 --max-tokens 3 --json {}",
                                                on.url(), dir.file("bench.json")));
  EXPECT_EQ(bench.exit_code, 0) << bench.err;
  EXPECT_NE(bench.out.find("24 shared + 2:6"), std::string::npos) << bench.out;
  const json doc = json::parse(slurp(dir.file("bench.json")));
  EXPECT_EQ(doc.at("shared_prefix"), 24);
  EXPECT_GT(doc.at("server_prefix_cache_hit_tokens").get<int64_t>(), 0) << bench.out;
  EXPECT_NE(bench.out.find("prefix cache: "), std::string::npos) << bench.out;

  EXPECT_EQ(on.terminate(), 0) << on.log();
  EXPECT_EQ(off.terminate(), 0) << off.log();
  EXPECT_NE(on.log().find("prefix cache on"), std::string::npos) << on.log();
  EXPECT_NE(off.log().find("prefix cache off (--disable-radix-cache)"), std::string::npos) << off.log();
}

}  // namespace
}  // namespace fulcrum::test
