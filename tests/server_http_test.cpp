// A real `fulcrum serve` process on loopback with real HTTP clients.
#include <thread>

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "backend/cpu/cpu_backend.hpp"
#include "model/generate.hpp"
#include "server_http_util.hpp"
#include "server_process.hpp"
#include "server_test_util.hpp"

namespace fulcrum::test {
namespace {

using nlohmann::json;

std::vector<int32_t> ids_of(const json& v) { return v.get<std::vector<int32_t>>(); }

class ServerHttp : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::signal(SIGPIPE, SIG_IGN);
    log_dir_ = new TempDir("serve_suite");
    server_ = new ServerProcess(tiny_served_model(),
                                {"--kv-pages", "48", "--page-size", "8", "--max-prefill-tokens", "64",
                                 "--max-running-requests", "16", "--expert-distribution-dir", log_dir_->path()},
                                log_dir_->file("serve.log"));
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->terminate(), 0) << server_->log();
    delete server_;
    delete log_dir_;
  }
  static int port() { return server_->port(); }

  // Standalone greedy continuation (no server).
  static std::vector<int32_t> greedy(const std::vector<int32_t>& prompt, int n) {
    static backend::CpuBackend backend;
    static std::unique_ptr<model::Qwen3MoeModel> solo = [] {
      auto m = std::make_unique<model::Qwen3MoeModel>(model::load_qwen3_moe_config(tiny_served_model()), backend);
      model::Checkpoint checkpoint(tiny_served_model());
      m->load_weights(checkpoint);
      return m;
    }();
    return model::generate_greedy(*solo, backend, {prompt}, n).new_tokens[0];
  }

  static TempDir* log_dir_;
  static ServerProcess* server_;
};
TempDir* ServerHttp::log_dir_ = nullptr;
ServerProcess* ServerHttp::server_ = nullptr;

TEST_F(ServerHttp, ConcurrentStreamingAndNonStreamingMatchStandaloneGreedy) {
  constexpr int kClients = 8, kNew = 8;
  std::vector<std::vector<int32_t>> prompts;
  for (int c = 0; c < kClients; ++c) {
    std::vector<int32_t> p;
    for (int i = 0; i < 3 + 11 * c; ++i) p.push_back((37 * c + 101 * i + 5) % 1900);
    prompts.push_back(p);
  }
  std::vector<std::vector<int32_t>> got(kClients);
  std::vector<json> usage(kClients);
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      const json body = {{"prompt", prompts[c]}, {"max_tokens", kNew}, {"ignore_eos", true}, {"stream", c % 2 == 0},
                         {"stream_options", {{"include_usage", true}}}};
      if (c % 2 == 0) {
        const Streamed s = stream_post(port(), "/v1/completions", body);
        ASSERT_EQ(s.status, 200) << s.body;
        EXPECT_TRUE(s.done);
        for (const json& e : s.events) {
          if (e.contains("usage")) usage[c] = e["usage"];
          if (!e["choices"].empty()) {
            for (const auto& t : e["choices"][0]["token_ids"]) got[c].push_back(t.get<int32_t>());
          }
        }
        EXPECT_EQ(s.events[s.events.size() - 2]["choices"][0]["finish_reason"], "length");
      } else {
        const auto [status, out] = post(port(), "/v1/completions", body.dump());
        ASSERT_EQ(status, 200) << out.dump();
        got[c] = ids_of(out["choices"][0]["token_ids"]);
        usage[c] = out["usage"];
        EXPECT_EQ(out["choices"][0]["finish_reason"], "length");
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int c = 0; c < kClients; ++c) {
    EXPECT_EQ(got[c], greedy(prompts[c], kNew)) << "client " << c;
    EXPECT_EQ(usage[c]["prompt_tokens"], prompts[c].size());
    EXPECT_EQ(usage[c]["completion_tokens"], kNew);
  }
  // /generate with ids gives the same tokens.
  const auto [status, out] = post(port(), "/generate",
                                  json{{"input_ids", prompts[3]}, {"sampling_params", {{"max_new_tokens", kNew}, {"ignore_eos", true}}}}.dump());
  ASSERT_EQ(status, 200) << out.dump();
  EXPECT_EQ(ids_of(out["output_ids"]), got[3]);
  EXPECT_EQ(out["meta_info"]["finish_reason"]["type"], "length");
}

TEST_F(ServerHttp, TextCompletionChatAndStopStrings) {
  const json body = {{"prompt", "The quick brown fox"}, {"max_tokens", 12}, {"ignore_eos", true}};
  const auto [status, out] = post(port(), "/v1/completions", body.dump());
  ASSERT_EQ(status, 200) << out.dump();
  const std::string text = out["choices"][0]["text"];
  // Streaming gives the same text, delta by delta.
  json streamed_body = body;
  streamed_body["stream"] = true;
  const Streamed s = stream_post(port(), "/v1/completions", streamed_body);
  std::string joined;
  for (const json& e : s.events) joined += e["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(joined, text);
  // A stop string cuts the text before it.
  size_t at = text.size() / 2;  // a stop string of two ASCII characters from the second half
  while (at + 1 < text.size() && !(std::isalpha(static_cast<unsigned char>(text[at])) &&
                                   std::isalpha(static_cast<unsigned char>(text[at + 1])))) {
    ++at;
  }
  if (at + 1 < text.size()) {
    json stop_body = body;
    stop_body["stop"] = text.substr(at, 2);
    SCOPED_TRACE("text '" + text + "', stop '" + text.substr(at, 2) + "'");
    const size_t cut = text.find(stop_body["stop"].get<std::string>());
    const auto [st, cut_out] = post(port(), "/v1/completions", stop_body.dump());
    ASSERT_EQ(st, 200) << cut_out.dump();
    EXPECT_EQ(cut_out["choices"][0]["text"], text.substr(0, cut));
    EXPECT_EQ(cut_out["choices"][0]["finish_reason"], "stop");
    stop_body["stream"] = true;
    const Streamed ss = stream_post(port(), "/v1/completions", stop_body);
    std::string streamed;
    for (const json& e : ss.events) streamed += e["choices"][0]["text"].get<std::string>();
    EXPECT_EQ(streamed, text.substr(0, cut));
  }
  // Chat, streaming with usage.
  const json chat = {{"messages", {{{"role", "user"}, {"content", "hi there"}}}}, {"max_tokens", 5}, {"stream", true},
                     {"stream_options", {{"include_usage", true}}}};
  const Streamed c = stream_post(port(), "/v1/chat/completions", chat);
  ASSERT_EQ(c.status, 200) << c.body;
  ASSERT_GE(c.events.size(), 3u);
  EXPECT_EQ(c.events[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(c.events[0]["object"], "chat.completion.chunk");
  EXPECT_TRUE(c.events.back()["choices"].empty());
  EXPECT_GT(c.events.back()["usage"]["prompt_tokens"].get<int>(), 2);
  EXPECT_TRUE(c.done);
}

TEST_F(ServerHttp, MalformedRequestsGetJsonErrorsAndTheServerKeepsServing) {
  const std::vector<std::tuple<std::string, std::string, int>> cases = {
      {"/v1/completions", "{\"prompt\": [1, 2", 400},
      {"/v1/completions", "[1, 2]", 400},
      {"/v1/completions", R"({"prompt": [1, 2], "max_tokenz": 3})", 400},
      {"/v1/completions", R"({"prompt": [1, 2], "max_tokens": "3"})", 400},
      {"/v1/completions", R"({"prompt": [1, 2], "temperature": -1})", 400},
      {"/v1/completions", R"({"prompt": [1, 99999]})", 400},
      {"/v1/completions", R"({"prompt": [1, 2], "model": "gpt-4"})", 404},
      {"/v1/chat/completions", R"({"messages": [{"role": "user"}]})", 400},
      {"/generate", R"({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "bogus": 1}})", 400},
      {"/generate", R"({"input_ids": [1], "sampling_params": {"max_new_tokens": 100000}})", 400},
      {"/no/such/route", "{}", 404},
  };
  for (const auto& [path, body, expected] : cases) {
    const auto [status, out] = post(port(), path, body);
    EXPECT_EQ(status, expected) << path << " " << body;
    EXPECT_TRUE(out.is_object() && out["error"]["message"].is_string() && out["error"]["type"].is_string())
        << path << " " << body << " -> " << out.dump();
  }
  // Oversized prompts: longer than the model (512 positions), or than the whole KV pool (48 pages x 8).
  const auto [long_status, long_out] = post(port(), "/v1/completions", json{{"prompt", std::vector<int32_t>(600, 7)}}.dump());
  EXPECT_EQ(long_status, 400);
  EXPECT_NE(long_out["error"]["message"].get<std::string>().find("512 positions"), std::string::npos) << long_out.dump();
  const std::vector<int32_t> huge(400, 7);
  const auto [status, out] = post(port(), "/v1/completions", json{{"prompt", huge}, {"max_tokens", 1}}.dump());
  EXPECT_EQ(status, 400);
  EXPECT_NE(out["error"]["message"].get<std::string>().find("KV pages"), std::string::npos) << out.dump();
  httplib::Client client("127.0.0.1", port());
  const httplib::Result health = client.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  const auto [ok, again] = post(port(), "/v1/completions", R"({"prompt": [1, 2], "max_tokens": 2})");
  EXPECT_EQ(ok, 200) << again.dump();
}

// A raw connection that sent one POST of `body` to `path`; the caller reads and closes it.
int send_raw_post(int port, const std::string& path, const std::string& body) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const std::string request = "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                              std::to_string(body.size()) + "\r\n\r\n" + body;
  EXPECT_EQ(::write(fd, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  return fd;
}

// Waits until no KV page is used and more requests than `cancelled_before` were cancelled; returns /metrics.
std::map<std::string, double> wait_for_cancellation(int port, double cancelled_before) {
  std::map<std::string, double> m;
  for (int i = 0; i < 1000; ++i) {
    m = metrics(port);
    if (m["fulcrum_kv_pages_used"] == 0 && m["fulcrum_requests_total{finish_reason=\"cancelled\"}"] > cancelled_before) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return m;
}

TEST_F(ServerHttp, ClientThatDisconnectsMidStreamIsCancelledAndItsPagesFreed) {
  std::map<std::string, double> before = metrics(port());
  const double cancelled_before = before["fulcrum_requests_total{finish_reason=\"cancelled\"}"];
  const double generated_before = before["fulcrum_generation_tokens_total"];
  const int fd = send_raw_post(
      port(), "/v1/completions", json{{"prompt", {1, 2, 3}}, {"max_tokens", 300}, {"ignore_eos", true}, {"stream", true}}.dump());
  std::string received;
  char buf[4096];
  while (std::count(received.begin(), received.end(), '\n') < 20) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    ASSERT_GT(n, 0);
    received.append(buf, static_cast<size_t>(n));
  }
  EXPECT_NE(received.find("data: {"), std::string::npos);
  ::close(fd);
  const std::map<std::string, double> m = wait_for_cancellation(port(), cancelled_before);
  EXPECT_EQ(m.at("fulcrum_kv_pages_used"), 0);
  EXPECT_GT(m.at("fulcrum_requests_total{finish_reason=\"cancelled\"}"), cancelled_before);
  EXPECT_LT(m.at("fulcrum_generation_tokens_total") - generated_before, 300);  // it stopped early
  const auto [ok, again] = post(port(), "/v1/completions", R"({"prompt": [1, 2], "max_tokens": 2})");
  EXPECT_EQ(ok, 200);
}

// A non-streaming client that closes its connection while its request runs: noticed by polling the
// socket, the request is cancelled and its pages freed long before its 370 tokens.
TEST_F(ServerHttp, NonStreamingClientThatDisconnectsIsCancelledAndItsPagesFreed) {
  std::map<std::string, double> before = metrics(port());
  const double cancelled_before = before["fulcrum_requests_total{finish_reason=\"cancelled\"}"];
  const double generated_before = before["fulcrum_generation_tokens_total"];
  const int fd = send_raw_post(port(), "/v1/completions",
                               json{{"prompt", {4, 5, 6}}, {"max_tokens", 370}, {"ignore_eos", true}}.dump());
  std::map<std::string, double> m;
  for (int i = 0; i < 1000 && m["fulcrum_generation_tokens_total"] - generated_before < 5; ++i) {
    m = metrics(port());  // until it is running
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GE(m["fulcrum_kv_pages_used"], 1);
  ::close(fd);
  m = wait_for_cancellation(port(), cancelled_before);
  EXPECT_EQ(m.at("fulcrum_kv_pages_used"), 0);
  EXPECT_GT(m.at("fulcrum_requests_total{finish_reason=\"cancelled\"}"), cancelled_before);
  EXPECT_LT(m.at("fulcrum_generation_tokens_total") - generated_before, 370);
  const auto [ok, again] = post(port(), "/v1/completions", R"({"prompt": [1, 2], "max_tokens": 2})");
  EXPECT_EQ(ok, 200);
}

TEST_F(ServerHttp, MetricsAreValidPrometheusText) {
  post(port(), "/v1/completions", R"({"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": true})");
  std::map<std::string, double> m = metrics(port());
  for (const char* name : {"fulcrum_requests_running", "fulcrum_requests_waiting", "fulcrum_prompt_tokens_total",
                           "fulcrum_generation_tokens_total", "fulcrum_step_seconds_count", "fulcrum_step_seconds_sum",
                           "fulcrum_kv_pages_used", "fulcrum_kv_pages_total", "fulcrum_eplb_rebalances_total",
                           "fulcrum_eplb_bytes_migrated_total", "fulcrum_step_seconds_bucket{le=\"+Inf\"}",
                           "fulcrum_scheduler_host_seconds_total"}) {
    EXPECT_TRUE(m.contains(name)) << name;
  }
  EXPECT_EQ(m["fulcrum_kv_pages_total"], 48);
  EXPECT_GE(m["fulcrum_prompt_tokens_total"], 3);
  EXPECT_GE(m["fulcrum_generation_tokens_total"], 3);
  EXPECT_EQ(m["fulcrum_step_seconds_bucket{le=\"+Inf\"}"], m["fulcrum_step_seconds_count"]);
  EXPECT_GT(m["fulcrum_scheduler_host_seconds_total"], 0) << "steps ran, so the scheduler spent time around them";
}

TEST_F(ServerHttp, ExpertDistributionDumpIsReadableByPlan) {
  ASSERT_EQ(post(port(), "/start_expert_distribution_record", "").first, 200);
  ASSERT_EQ(post(port(), "/v1/completions", R"({"prompt": [9, 8, 7, 6], "max_tokens": 4, "ignore_eos": true})").first, 200);
  ASSERT_EQ(post(port(), "/stop_expert_distribution_record", "").first, 200);
  const auto [status, out] = post(port(), "/dump_expert_distribution_record", R"({"name": "dist.json"})");
  ASSERT_EQ(status, 200) << out.dump();
  EXPECT_EQ(out["num_tokens"], 7);  // 4 prompt tokens + 3 decode steps
  EXPECT_EQ(out["logical_count"].size(), 2u);
  EXPECT_EQ(out["logical_count"][0].size(), 128u);
  const std::string file = log_dir_->file("dist.json");
  EXPECT_EQ(json::parse(slurp(file))["logical_count"], out["logical_count"]);
  TempDir dir("plan_dump");
  const CliRun plan = run_cli(dir, "plan --loads " + file + " --gpus 4 --physical-experts 136 --json");
  EXPECT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_NE(plan.out.find("balancedness_mean"), std::string::npos) << plan.out;
}

// Dump names (issue 15): "a\u0000b" once answered 200 and wrote "a"; "\u0000" or 300 bytes answered 500 with the
// server's absolute path. Each is a 400 now, one line, naming no server path, and writes nothing.
TEST_F(ServerHttp, DumpNamesThatAreNotPlainFileNamesAre400sThatRevealNoPath) {
  const std::vector<std::pair<json, std::string>> cases = {
      {json{{"name", std::string("a\0b", 3)}}, "NUL"},
      {json{{"name", std::string(1, '\0')}}, "NUL"},
      {json{{"name", std::string(300, 'n')}}, "1 to 240 bytes, got 300"},
      {json{{"name", std::string(241, 'n')}}, "1 to 240 bytes, got 241"},
      {json{{"name", ""}}, "1 to 240 bytes, got 0"},
      {json{{"name", "../escape.json"}}, "plain file name"},
      {json{{"name", ".."}}, "plain file name"},
      {json{{"name", "."}}, "plain file name"},
      {json{{"name", 7}}, "must be a string"},
  };
  for (const auto& [body, needle] : cases) {
    const auto [status, out] = post(port(), "/dump_expert_distribution_record", body.dump());
    EXPECT_EQ(status, 400) << body.dump();
    const std::string message = out["error"]["message"].is_string() ? out["error"]["message"].get<std::string>() : "";
    EXPECT_NE(message.find(needle), std::string::npos) << body.dump() << " -> " << message;
    EXPECT_EQ(message.find(log_dir_->path()), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_LT(message.size(), 120u) << message;
  }
  EXPECT_FALSE(std::filesystem::exists(log_dir_->file("a")));
  // The longest name accepted is written.
  const std::string longest(240, 'n');
  const auto [status, out] = post(port(), "/dump_expert_distribution_record", json{{"name", longest}}.dump());
  EXPECT_EQ(status, 200) << out.dump();
  EXPECT_TRUE(std::filesystem::exists(log_dir_->file(longest)));
}

// A body nested 100k deep once crashed the server (the parser's recursion) or cost ~64 MB each: now a 400 before
// parsing, and the server keeps serving.
TEST_F(ServerHttp, DeeplyNestedJsonBodiesAre400s) {
  for (const char* path : {"/v1/completions", "/v1/chat/completions", "/generate", "/dump_expert_distribution_record"}) {
    const auto [status, out] = post(port(), path, "{\"prompt\": " + std::string(100000, '['));
    EXPECT_EQ(status, 400) << path;
    EXPECT_EQ(out["error"]["message"], "the request body nests JSON deeper than 256 levels") << out.dump();
  }
  const auto [ok, again] = post(port(), "/v1/completions", R"({"prompt": [1, 2], "max_tokens": 2})");
  EXPECT_EQ(ok, 200) << again.dump();
}

// 404s (unrouted paths) and 413s (bodies over the limit) are refusals as much as 400s are, each under its reason.
TEST_F(ServerHttp, NotFoundAndPayloadTooLargeAreCountedAsRejected) {
  const auto rejected = [](const std::string& reason) {
    return metrics(port())["fulcrum_requests_rejected_total{reason=\"" + reason + "\"}"];
  };
  const double not_found = rejected("not_found"), too_large = rejected("body_too_large"), bad = rejected("bad_request");
  EXPECT_EQ(post(port(), "/no/such/route", "{}").first, 404);
  httplib::Client client("127.0.0.1", port());
  const httplib::Result missing = client.Get("/nowhere");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  const httplib::Result big = client.Post("/v1/completions", std::string(9u << 20, ' '), "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  EXPECT_EQ(post(port(), "/v1/completions", "[1, 2]").first, 400);
  EXPECT_EQ(rejected("not_found") - not_found, 2);
  EXPECT_EQ(rejected("body_too_large") - too_large, 1);
  EXPECT_EQ(rejected("bad_request") - bad, 1);
}

TEST(ServerShutdown, SigtermFinishesInFlightStreamsAndExitsCleanly) {
  std::signal(SIGPIPE, SIG_IGN);
  TempDir dir("serve_shutdown");
  ServerProcess server(tiny_served_model(), {}, dir.file("serve.log"));
  Streamed s;
  std::thread client([&] {
    s = stream_post(server.port(), "/v1/completions",
                    json{{"prompt", {4, 5, 6}}, {"max_tokens", 500}, {"ignore_eos", true}, {"stream", true}});
  });
  // SIGTERM only once the stream is running (a fixed sleep lost the race on a loaded machine).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (metrics(server.port())["fulcrum_requests_running"] < 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(server.terminate(), 0) << server.log();
  client.join();
  EXPECT_EQ(s.status, 200);
  EXPECT_TRUE(s.done);
  EXPECT_NE(server.log().find("SIGTERM: draining"), std::string::npos) << server.log();
  EXPECT_NE(server.log().find("stopped"), std::string::npos) << server.log();
}

}  // namespace
}  // namespace fulcrum::test
