#include "server/load_generator.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "eplb/error.hpp"
#include "eplb/json_text.hpp"
#include "model/rng.hpp"

namespace fulcrum::server {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double since(Clock::time_point t0, Clock::time_point t1) { return std::chrono::duration<double>(t1 - t0).count(); }

struct ServedModel {
  std::string name;
  int vocab_size = 0;
};

ServedModel query_model(const std::string& url) {
  httplib::Client client(url);
  client.set_connection_timeout(5);
  const httplib::Result res = client.Get("/v1/models");
  FULCRUM_CHECK(res && res->status == 200, "{}/v1/models: {}", url, res ? fmt::format("HTTP {}", res->status) : httplib::to_string(res.error()));
  const json body = eplb::parse_json_text(res->body, url + "/v1/models");
  const json& model = body.at("data").at(0);
  return {model.at("id").get<std::string>(), model.at("vocab_size").get<int>()};
}

// Counters of /metrics by name (a Prometheus text line "name value"); absent ones are missing.
std::map<std::string, double> scrape_counters(const std::string& url, const std::vector<std::string>& names) {
  std::map<std::string, double> out;
  httplib::Client client(url);
  client.set_connection_timeout(5);
  const httplib::Result res = client.Get("/metrics");
  if (!res || res->status != 200) return out;
  std::istringstream lines(res->body);
  for (std::string line; std::getline(lines, line);) {
    for (const std::string& name : names) {
      if (line.rfind(name + " ", 0) == 0) out[name] = std::stod(line.substr(name.size() + 1));
    }
  }
  return out;
}

// One streaming request; appends its timings to `local` and returns an error message or "".
std::string one_request(httplib::Client& client, const ServedModel& model, const LoadOptions& o,
                        const std::vector<int32_t>& prefix, model::Rng& rng, LoadReport& local) {
  const int span = o.prompt_max - o.prompt_min + 1;
  const int own = o.prompt_min + static_cast<int>(rng.next() % static_cast<uint64_t>(span));
  std::vector<int32_t> prompt = prefix;
  for (int i = 0; i < own; ++i) prompt.push_back(static_cast<int32_t>(rng.next() % static_cast<uint64_t>(model.vocab_size)));
  const auto length = static_cast<int64_t>(prompt.size());
  const json body = {{"model", model.name}, {"prompt", prompt}, {"max_tokens", o.max_tokens}, {"ignore_eos", true},
                     {"stream", true}, {"stream_options", {{"include_usage", true}}}};
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  std::string buffer;
  std::vector<Clock::time_point> token_times;
  bool saw_done = false;
  int64_t usage_tokens = -1;
  std::string error;
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    const Clock::time_point now = Clock::now();
    buffer.append(data, size);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos; buffer.erase(0, end + 2)) {
      const std::string event = buffer.substr(0, end);
      if (!event.starts_with("data: ")) continue;  // keep-alive comment
      if (event == "data: [DONE]") {
        saw_done = true;
        continue;
      }
      const std::string_view data_text = std::string_view(event).substr(6);
      const json chunk = eplb::find_json_depth_overflow(data_text) ? json(json::value_t::discarded)
                                                                   : json::parse(data_text, nullptr, false);
      if (chunk.is_discarded()) {
        error = "unparsable SSE event";
        return false;
      }
      // Other OpenAI-style servers send "usage": null on all but the last chunk.
      if (chunk.contains("usage") && chunk["usage"].is_object()) {
        usage_tokens = chunk["usage"].value("completion_tokens", -1);
      }
      if (chunk.contains("choices") && !chunk["choices"].empty()) {
        const json& choice = chunk["choices"][0];
        for (size_t i = 0; i < choice.value("token_ids", json::array()).size(); ++i) token_times.push_back(now);
      }
    }
    return true;
  };
  const Clock::time_point start = Clock::now();
  const httplib::Result res = client.send(req);
  const Clock::time_point end = Clock::now();
  if (!res) {
    return fmt::format("{} after {:.3f} s and {} token event(s)",
                       error.empty() ? "transport: " + httplib::to_string(res.error()) : error, since(start, end),
                       token_times.size());
  }
  if (res->status != 200) return fmt::format("HTTP {}: {}", res->status, res->body.substr(0, 200));
  if (!saw_done) return "stream ended without [DONE]";
  if (usage_tokens != static_cast<int64_t>(token_times.size())) {
    return fmt::format("usage says {} tokens, the stream carried {}", usage_tokens, token_times.size());
  }
  if (!token_times.empty()) {
    local.ttft_s.push_back(since(start, token_times.front()));
    for (size_t i = 1; i < token_times.size(); ++i) local.itl_s.push_back(since(token_times[i - 1], token_times[i]));
  }
  local.latency_s.push_back(since(start, end));
  local.prompt_tokens += length;
  local.output_tokens += static_cast<int64_t>(token_times.size());
  return {};
}

}  // namespace

double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(values.size())));
  return values[std::clamp<size_t>(rank, 1, values.size()) - 1];
}

LoadReport run_load(const LoadOptions& o) {
  FULCRUM_CHECK(o.clients > 0, "--clients must be positive, got {}", o.clients);
  FULCRUM_CHECK(o.duration_s > 0 || o.requests > 0, "--requests must be positive, got {}", o.requests);
  FULCRUM_CHECK(o.prompt_min >= 1 && o.prompt_min <= o.prompt_max, "--prompt-len A:B needs 1 <= A <= B");
  FULCRUM_CHECK(o.max_tokens >= 1, "--max-tokens must be positive, got {}", o.max_tokens);
  FULCRUM_CHECK(o.shared_prefix >= 0, "--shared-prefix must be >= 0, got {}", o.shared_prefix);
  const ServedModel model = query_model(o.url);
  std::vector<int32_t> prefix;
  model::Rng prefix_rng(o.seed, "shared prefix");
  for (int i = 0; i < o.shared_prefix; ++i) {
    prefix.push_back(static_cast<int32_t>(prefix_rng.next() % static_cast<uint64_t>(model.vocab_size)));
  }
  constexpr const char* kPrompt = "fulcrum_prompt_tokens_total";
  constexpr const char* kHits = "fulcrum_prefix_cache_hit_tokens_total";
  constexpr const char* kSteps = "fulcrum_step_tokens_total";
  constexpr const char* kStepCount = "fulcrum_step_seconds_count";
  constexpr const char* kStepSum = "fulcrum_step_seconds_sum";
  constexpr const char* kHost = "fulcrum_scheduler_host_seconds_total";
  const std::vector<std::string> counters = {kPrompt, kHits, kSteps, kStepCount, kStepSum, kHost};
  const std::map<std::string, double> before = scrape_counters(o.url, counters);
  std::atomic<int> issued{0};
  std::mutex mutex;
  LoadReport report;
  const Clock::time_point start = Clock::now();
  const auto more = [&] {
    if (o.duration_s > 0) return since(start, Clock::now()) < o.duration_s;
    return issued.fetch_add(1) < o.requests;
  };
  std::vector<std::thread> threads;
  for (int c = 0; c < o.clients; ++c) {
    threads.emplace_back([&, c] {
      httplib::Client client(o.url);
      client.set_read_timeout(120);
      client.set_connection_timeout(10);
      model::Rng rng(o.seed, fmt::format("client{}", c));
      LoadReport local;
      while (more()) {
        std::string error;
        try {  // a malformed response must count as a failed request, not end the process
          error = one_request(client, model, o, prefix, rng, local);
        } catch (const std::exception& e) {
          error = std::string("bad response: ") + e.what();
        }
        if (error.empty()) {
          ++local.succeeded;
        } else {
          ++local.failed;
          if (local.errors.size() < 5) local.errors.push_back(error);
        }
      }
      std::lock_guard lock(mutex);
      report.succeeded += local.succeeded;
      report.failed += local.failed;
      report.prompt_tokens += local.prompt_tokens;
      report.output_tokens += local.output_tokens;
      report.ttft_s.insert(report.ttft_s.end(), local.ttft_s.begin(), local.ttft_s.end());
      report.itl_s.insert(report.itl_s.end(), local.itl_s.begin(), local.itl_s.end());
      report.latency_s.insert(report.latency_s.end(), local.latency_s.begin(), local.latency_s.end());
      for (std::string& e : local.errors) {
        if (report.errors.size() < 5) report.errors.push_back(std::move(e));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  report.seconds = since(start, Clock::now());
  const std::map<std::string, double> after = scrape_counters(o.url, counters);
  const auto delta = [&](const char* name) -> double {
    return before.contains(name) && after.contains(name) ? after.at(name) - before.at(name) : -1;
  };
  report.server_prompt_tokens = static_cast<int64_t>(delta(kPrompt));
  report.server_hit_tokens = static_cast<int64_t>(delta(kHits));
  report.server_step_tokens = static_cast<int64_t>(delta(kSteps));
  report.server_steps = static_cast<int64_t>(delta(kStepCount));
  if (report.server_steps > 0) {
    if (delta(kStepSum) >= 0) report.server_step_ms_mean = 1000.0 * delta(kStepSum) / report.server_steps;
    if (delta(kHost) >= 0) report.server_host_ms_per_step = 1000.0 * delta(kHost) / report.server_steps;
  }
  return report;
}

std::string format_load_report(const LoadOptions& o, const LoadReport& r) {
  const auto ms = [](const std::vector<double>& v, double q) { return 1000.0 * percentile(v, q); };
  std::string out = fmt::format("requests: {} ok, {} failed in {:.2f} s ({} clients, prompt {}{}:{}, max_tokens {})\n",
                                r.succeeded, r.failed, r.seconds, o.clients,
                                o.shared_prefix > 0 ? fmt::format("{} shared + ", o.shared_prefix) : "", o.prompt_min,
                                o.prompt_max, o.max_tokens);
  out += fmt::format("throughput: {:.2f} req/s, {:.1f} output tok/s, {:.1f} prompt tok/s\n", r.succeeded / r.seconds,
                     static_cast<double>(r.output_tokens) / r.seconds, static_cast<double>(r.prompt_tokens) / r.seconds);
  for (const auto& [name, values] : {std::pair<const char*, const std::vector<double>*>{"TTFT", &r.ttft_s},
                                     {"ITL", &r.itl_s}, {"latency", &r.latency_s}}) {
    out += fmt::format("{:8} ms: p50 {:.2f}  p90 {:.2f}  p99 {:.2f}  ({} samples)\n", name, ms(*values, 0.5),
                       ms(*values, 0.9), ms(*values, 0.99), values->size());
  }
  if (r.server_hit_tokens >= 0 && r.server_prompt_tokens > 0) {
    out += fmt::format("prefix cache: {} of {} prompt tokens read from the cache (hit ratio {:.3f}); {} tokens computed\n",
                       r.server_hit_tokens, r.server_prompt_tokens,
                       static_cast<double>(r.server_hit_tokens) / static_cast<double>(r.server_prompt_tokens),
                       r.server_step_tokens);
  }
  if (r.server_steps > 0 && r.server_step_ms_mean >= 0 && r.server_host_ms_per_step >= 0) {
    out += fmt::format("server: {} steps, {:.3f} ms a step, {:.3f} ms of scheduler host work around each\n",
                       r.server_steps, r.server_step_ms_mean, r.server_host_ms_per_step);
  }
  for (const std::string& e : r.errors) out += "error: " + e + "\n";
  return out;
}

}  // namespace fulcrum::server
