#pragma once
// The PyTorch peer of `fulcrum bench moe` (bench/peer/torch_moe_peer.py): the routing file the script reads, running
// it, and the ratios against Fulcrum's figures. No CUDA here; the functions are inline so the CPU tests reach them
// without linking the CUDA benchmark library (tests/bench_moe_torch_peer_test.cpp).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include "eplb/error.hpp"
#include "eplb/json_text.hpp"

namespace fulcrum::bench_moe {

inline constexpr const char* kDefaultTorchPeerScript = "bench/peer/torch_moe_peer.py";

// One batch's routing as the peer must reproduce it: each token's top-k experts ([T, k] row-major) and the rows per
// expert (the layer's own slot counts under the trivial map).
struct PeerRouting {
  int64_t tokens = 0;
  std::vector<int32_t> topk_ids;
  std::vector<int32_t> expert_counts;
};

// Each row's top_k largest logits of [tokens, experts], largest first (ties to the lower index): what the router
// picks (softmax keeps the order).
inline std::vector<int32_t> topk_of_logits(const std::vector<float>& logits, int64_t tokens, int experts, int top_k) {
  FULCRUM_CHECK(top_k >= 1 && top_k <= experts && logits.size() == size_t(tokens) * experts,
                "topk_of_logits: {} logits for {} tokens x {} experts, top-{}", logits.size(), tokens, experts, top_k);
  std::vector<int32_t> ids(static_cast<size_t>(tokens) * top_k), order(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = logits.data() + t * experts;
    for (int e = 0; e < experts; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [row](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    std::copy(order.begin(), order.begin() + top_k, ids.begin() + t * top_k);
  }
  return ids;
}

inline std::vector<int32_t> expert_counts_of(const std::vector<int32_t>& topk_ids, int experts) {
  std::vector<int32_t> counts(size_t(experts), 0);
  for (const int32_t e : topk_ids) {
    FULCRUM_CHECK(e >= 0 && e < experts, "expert id {} outside [0, {})", e, experts);
    ++counts[size_t(e)];
  }
  return counts;
}

// The script's --routing document: {"experts", "top_k", "models": [{name, hidden, intermediate}], "routing": [...]}.
inline nlohmann::json peer_routing_json(const std::vector<nlohmann::json>& models, const std::vector<PeerRouting>& routing,
                                        int experts, int top_k) {
  nlohmann::json batches = nlohmann::json::array();
  for (const PeerRouting& r : routing)
    batches.push_back({{"tokens", r.tokens}, {"expert_counts", r.expert_counts}, {"topk_ids", r.topk_ids}});
  return {{"experts", experts}, {"top_k", top_k}, {"models", models}, {"routing", batches}};
}

// --torch-peer: "off" -> "" (no note); "auto" -> kDefaultTorchPeerScript when it is here and `python3 -c 'import
// torch'` works, else "" and *note says why; anything else: that script.
inline std::string resolve_torch_peer(const std::string& option, std::string* note) {
  if (option == "off") return "";
  if (option != "auto") return option;
  if (!std::filesystem::is_regular_file(kDefaultTorchPeerScript)) {
    *note = fmt::format("torch peer off: no {} in this folder (--torch-peer PATH names the script)", kDefaultTorchPeerScript);
    return "";
  }
  if (std::system("python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    *note = "torch peer off: python3 here cannot import torch (--torch-peer PATH runs the script anyway)";
    return "";
  }
  return kDefaultTorchPeerScript;
}

// The text in single quotes for /bin/sh (a path may hold spaces).
inline std::string shell_quoted(const std::string& text) {
  std::string q = "'";
  for (const char c : text) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs `python3 SCRIPT --routing FILE --warmup W --reps R --out FILE` with the routing document in a fresh temp
// folder, echoing its output as "# torch peer| ..." lines. Returns the script's JSON, or {"error": "<one line>"}
// (its last line of output, or what went wrong); never throws: a failing peer must not end the benchmark.
inline nlohmann::json run_torch_peer(const std::string& script, const nlohmann::json& routing_doc, int warmup, int reps) {
  namespace fs = std::filesystem;
  fs::path dir;
  try {
    static int runs = 0;
    dir = fs::temp_directory_path() / fmt::format("fulcrum-torch-peer-{}-{}", ::getpid(), runs++);
    fs::remove_all(dir);
    fs::create_directories(dir);
    const fs::path routing = dir / "routing.json", result = dir / "peer.json";
    std::ofstream(routing) << routing_doc.dump() << "\n";
    const std::string cmd = fmt::format("python3 {} --routing {} --warmup {} --reps {} --out {} 2>&1", shell_quoted(script),
                                        shell_quoted(routing.string()), warmup, reps, shell_quoted(result.string()));
    std::string last;
    int status = -1;
    if (FILE* pipe = popen(cmd.c_str(), "r")) {
      char buf[4096];
      while (fgets(buf, sizeof buf, pipe) != nullptr) {
        std::string line = buf;
        while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
        if (!line.empty()) last = line;
        fmt::print("# torch peer| {}\n", line);
      }
      status = pclose(pipe);
    }
    std::fflush(stdout);
    nlohmann::json out;
    if (status != 0 || !fs::is_regular_file(result)) {
      const int code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      out = {{"error", last.empty() ? fmt::format("{} exited with status {} and printed nothing", script, code)
                                    : eplb::printable_excerpt(last, 300)}};
    } else {
      std::ostringstream text;
      text << std::ifstream(result).rdbuf();
      out = eplb::parse_json_text(text.str(), fmt::format("{}'s result", script));
      if (!out.is_object() || !out.contains("results") || !out["results"].is_array())
        out = {{"error", fmt::format("{}'s result has no 'results' list", script)}};
    }
    fs::remove_all(dir);
    return out;
  } catch (const std::exception& e) {
    std::error_code ignored;
    if (!dir.empty()) fs::remove_all(dir, ignored);
    return {{"error", eplb::printable_excerpt(e.what(), 300)}};
  }
}

// The peer's row for (model, tokens), or nullptr.
inline const nlohmann::json* torch_peer_row(const nlohmann::json& peer, const std::string& model, int64_t tokens) {
  if (!peer.is_object() || !peer.contains("results")) return nullptr;
  for (const auto& r : peer["results"])
    if (r.value("model", "") == model && r.value("tokens", int64_t{-1}) == tokens) return &r;
  return nullptr;
}

// Adds to each "uniform" result of `results` (bench moe's rows) that the peer timed:
//   layer_vs_torch   = torch layer ms / Fulcrum layer_ms_recorder_off (the peer records nothing)
//   experts_vs_torch = torch experts ms / Fulcrum expert_gemm.cutlass.ms
// and returns how many rows got them. Rows of other scenarios are left alone (the peer ran uniform routing only).
inline int add_torch_ratios(nlohmann::json& results, const nlohmann::json& peer) {
  int matched = 0;
  for (auto& r : results) {
    if (r.value("scenario", "") != "uniform") continue;
    const nlohmann::json* p = torch_peer_row(peer, r.value("model", ""), r.value("tokens", int64_t{-1}));
    if (p == nullptr || !p->contains("layer_ms") || !p->at("layer_ms").is_number() || !p->contains("experts_ms") ||
        !p->at("experts_ms").is_number())
      continue;
    r["layer_vs_torch"] = p->at("layer_ms").get<double>() / r.at("layer_ms_recorder_off").get<double>();
    r["experts_vs_torch"] = p->at("experts_ms").get<double>() / r.at("expert_gemm").at("cutlass").at("ms").get<double>();
    ++matched;
  }
  return matched;
}

}  // namespace fulcrum::bench_moe
