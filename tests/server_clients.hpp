#pragma once
// Concurrent greedy clients of the server tests (half streaming, half not) whose prompts are a pure
// function of (client, request), so one server's answers can be compared with another's or with generate.
// Include only from files compiled with cpp-httplib's flags (tests/CMakeLists.txt).
#include <functional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "server_http_util.hpp"

namespace fulcrum::test {

// Request r of client c: 4..27 token ids in [0, 256), a pure function of (c, r).
inline std::vector<int32_t> prompt_of(int c, int r) {
  std::vector<int32_t> p;
  const int length = 4 + (7 * c + 5 * r) % 24;
  for (int i = 0; i < length; ++i) p.push_back((31 * c + 17 * r + 101 * i + 3) % 256);
  return p;
}

// Runs `requests_per_client` sequential greedy requests on each of `clients` threads, even clients
// streaming, odd ones not; returns the tokens of request (c, r) at c * requests_per_client + r. Request
// (c, r) sends prompt(c, r).
inline std::vector<std::vector<int32_t>> run_clients(
    int port, int clients, int requests_per_client, int max_tokens,
    const std::function<std::vector<int32_t>(int, int)>& prompt = prompt_of) {
  std::vector<std::vector<int32_t>> got(static_cast<size_t>(clients * requests_per_client));
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      for (int r = 0; r < requests_per_client; ++r) {
        const bool stream = c % 2 == 0;
        const json body = {{"prompt", prompt(c, r)}, {"max_tokens", max_tokens}, {"ignore_eos", true}, {"stream", stream}};
        std::vector<int32_t>& tokens = got[static_cast<size_t>(c * requests_per_client + r)];
        if (stream) {
          const Streamed s = stream_post(port, "/v1/completions", body);
          EXPECT_EQ(s.status, 200) << s.body;
          EXPECT_TRUE(s.done);
          for (const json& e : s.events) {
            for (const auto& t : e["choices"][0]["token_ids"]) tokens.push_back(t.get<int32_t>());
          }
        } else {
          const auto [status, out] = post(port, "/v1/completions", body.dump());
          EXPECT_EQ(status, 200) << out.dump();
          if (status == 200) tokens = out["choices"][0]["token_ids"].get<std::vector<int32_t>>();
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return got;
}

inline std::vector<std::vector<int32_t>> all_prompts(int clients, int requests_per_client) {
  std::vector<std::vector<int32_t>> prompts;
  for (int c = 0; c < clients; ++c) {
    for (int r = 0; r < requests_per_client; ++r) prompts.push_back(prompt_of(c, r));
  }
  return prompts;
}

// "balancedness B -> A" of every applied rebalance line in a server log.
inline std::vector<std::pair<double, double>> logged_rebalances(const std::string& log) {
  std::vector<std::pair<double, double>> out;
  const std::regex line(R"(eplb: rebalance \d+ at pass \d+: MoE layers [^:]*: balancedness ([0-9.]+) -> ([0-9.]+), .* ms)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator(); ++it) {
    out.emplace_back(std::stod((*it)[1]), std::stod((*it)[2]));
  }
  return out;
}

}  // namespace fulcrum::test
