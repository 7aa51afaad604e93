#pragma once
// What the GPU engine's expert-parallel rank tests share (gpu_engine_ep_test.cpp, gpu_engine_ep_eplb_test.cpp): two
// ranks as threads on one GPU, their engine options, prompts and placements, and one batched forward's last logits.
// Tolerance: against the one-GPU engine on the same sequences, an EP rank's expert GEMMs group its rows per
// (source rank, slot) instead of per slot, so the GEMMs may sum in another order and round the expert rows to bf16
// elsewhere: the batching argument of gpu_engine_test.cpp, kEpRelTolerance = 0.01 on logits.
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_check.hpp"
#include "comm/host_staged_exchange.hpp"
#include "comm/in_process_communicator.hpp"
#include "eplb/placement.hpp"
#include "gpu/gpu_engine.hpp"
#include "gpu_engine_test_util.hpp"
#include "http_raw_client.hpp"
#include "model_test_util.hpp"
#include "server_process.hpp"

namespace fulcrum::test {

constexpr double kEpRelTolerance = 0.01;
constexpr int kRanks = 2;

inline gpu::GpuEngineOptions ep_options() {
  gpu::GpuEngineOptions o;
  o.max_batch_tokens = 1024;
  o.max_batch_seqs = 8;
  o.kv_pages = 256;  // two engines share the GPU: no fraction of free memory
  return o;
}

// One forward_logits call over all `prompts` (sequence ids first_id, first_id + 1, ...): each prompt's last logits.
inline std::vector<std::vector<float>> last_logits_together(gpu::GpuEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                                     int64_t first_id) {
  std::vector<model::StepSequence> batch;
  for (size_t i = 0; i < prompts.size(); ++i) {
    engine.allocate(first_id + static_cast<int64_t>(i), static_cast<int64_t>(prompts[i].size()) + 8);
    batch.push_back(entry(first_id + static_cast<int64_t>(i), prompts[i], false));
  }
  const std::vector<model::HostTensor> logits = engine.forward_logits(batch);
  std::vector<std::vector<float>> out;
  const int v = engine.vocab_size();
  for (const model::HostTensor& t : logits) out.emplace_back(t.data.end() - v, t.data.end());
  for (size_t i = 0; i < prompts.size(); ++i) engine.release(first_id + static_cast<int64_t>(i));
  return out;
}

// A placement of `slots` slots over `gpus` GPUs: experts permuted per layer, the slots past E replicas of 3 experts.
inline eplb::Placement moved_placement(const model::Qwen3MoeConfig& config, int slots, int gpus) {
  const int num_moe = static_cast<int>(config.moe_layer_indices().size()), e = config.num_experts;
  eplb::Placement p(eplb::Topology{slots, gpus, 1}, num_moe, e);
  for (int l = 0; l < num_moe; ++l) {
    for (int s = 0; s < slots; ++s) p.layer(l)[static_cast<size_t>(s)] = s < e ? (s * 7 + l) % e : (s - e) % 3;
  }
  return p;
}

// Prompts of awkward lengths: rank 0 runs the first two, rank 1 the last two (a one-token prompt among them).
inline std::vector<std::vector<int32_t>> ep_prompts(int vocab) {
  return {random_tokens(300, vocab, 1), random_tokens(17, vocab, 2), random_tokens(1, vocab, 3), random_tokens(45, vocab, 4)};
}

// Every prompt's last logits on 2 EP ranks (rank r runs prompts 2r, 2r + 1; with rank_one_idle, rank 1 runs none and
// joins with an empty batch), in prompt order; the idle rank's entries stay empty. With `live`, the ranks first take
// one forward at `placement`, then apply_placement(*live) (collective; each rank's moved slots into *moved).
inline std::vector<std::vector<float>> ep_logits(const model::Qwen3MoeConfig& config, const eplb::Placement& placement,
                                                 eplb::DispatchAlgorithm dispatch, bool rank_one_idle,
                                                 const eplb::Placement* live = nullptr,
                                                 std::array<int64_t, kRanks>* moved = nullptr) {
  const std::vector<std::vector<int32_t>> prompts = ep_prompts(config.vocab_size);
  std::array<std::vector<std::vector<float>>, kRanks> per_rank;
  comm::run_in_process(kRanks, [&](int rank, comm::Communicator& comm) {
    FULCRUM_CUDA_CHECK(cudaSetDevice(0));
    comm::HostStagedExchange exchange(comm, 0);
    gpu::GpuEngineOptions o = ep_options();
    o.ep = &exchange;
    o.placement = placement;
    o.dispatch = dispatch;
    gpu::GpuEngine engine(config, o);
    engine.fill_random(21);
    std::vector<std::vector<int32_t>> mine;
    if (!(rank == 1 && rank_one_idle)) mine = {prompts[2 * rank], prompts[2 * rank + 1]};
    if (live != nullptr) {
      if (!mine.empty()) (void)last_logits_together(engine, mine, 100 + 10 * rank);
      if (mine.empty()) (void)engine.forward_logits({});
      const int64_t n = engine.apply_placement(*live);
      if (moved != nullptr) (*moved)[static_cast<size_t>(rank)] = n;
      EXPECT_EQ(engine.placement().physical_to_logical_map, live->physical_to_logical_map);
    }
    per_rank[static_cast<size_t>(rank)] = mine.empty() ? std::vector<std::vector<float>>{}
                                                       : last_logits_together(engine, mine, 10 * rank);
    if (mine.empty()) EXPECT_TRUE(engine.forward_logits({}).empty());  // joined the layers' exchanges
  });
  std::vector<std::vector<float>> all(prompts.size());
  for (int r = 0; r < kRanks; ++r) {
    for (size_t i = 0; i < per_rank[static_cast<size_t>(r)].size(); ++i) all[2 * r + i] = per_rank[static_cast<size_t>(r)][i];
  }
  return all;
}

constexpr int kServeClients = 4, kServeMaxTokens = 6;

// `serve --device cuda` on the golden tiny model with `layout`'s extra flags: kServeClients concurrent greedy requests
// (prompts of 5, 14, 23, 32 tokens, kServeMaxTokens each), each one's tokens; with `metrics`, /metrics after them.
inline std::vector<std::vector<int32_t>> serve_greedy_answers(const std::vector<std::string>& layout,
                                                              const std::string& name, std::string* metrics = nullptr) {
  const TempDir tmp(name);
  std::vector<std::string> flags = {"--device", "cuda", "--kv-pages", "64", "--max-running-requests", "4"};
  flags.insert(flags.end(), layout.begin(), layout.end());
  ServerProcess server(golden_model_dir("qwen3moe-tiny-128e"), flags, tmp.path() + "/serve.log");
  std::vector<std::vector<int32_t>> tokens(kServeClients);
  std::vector<std::thread> clients;
  for (int c = 0; c < kServeClients; ++c) {
    clients.emplace_back([&, c] {
      std::vector<int32_t> prompt;
      for (int i = 0; i < 5 + 9 * c; ++i) prompt.push_back((31 * c + 101 * i + 3) % 256);
      const std::string body = nlohmann::json{{"prompt", prompt}, {"max_tokens", kServeMaxTokens}, {"temperature", 0},
                                              {"ignore_eos", true}}.dump();
      const std::optional<RawResponse> response = post_json(server.port(), "/v1/completions", body);
      ASSERT_TRUE(response.has_value()) << server.log();
      ASSERT_EQ(response->status, 200) << response->body << "\n" << server.log();
      tokens[static_cast<size_t>(c)] =
          nlohmann::json::parse(response->body)["choices"][0]["token_ids"].get<std::vector<int32_t>>();
    });
  }
  for (std::thread& t : clients) t.join();
  if (!layout.empty()) EXPECT_NE(server.log().find("GPU engine ranks"), std::string::npos) << server.log();
  if (metrics != nullptr) {
    const std::optional<RawResponse> m = get_path(server.port(), "/metrics");
    EXPECT_TRUE(m.has_value());
    if (m.has_value()) *metrics = m->body;
  }
  return tokens;
}

}  // namespace fulcrum::test
