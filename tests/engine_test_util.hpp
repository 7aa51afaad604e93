#pragma once
// Helpers of the engine tests: a fixed two-pass token schedule (a prefill of three prompts of awkward
// lengths, then one decode token each) run on the single-rank model and on in-process parallel ranks.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

#include "backend/cpu/cpu_backend.hpp"
#include "comm/in_process_communicator.hpp"
#include "engine/rank_engine.hpp"
#include "eplb/loads.hpp"
#include "eplb/planner.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {

inline const char* const k128e = "qwen3moe-tiny-128e";      // 3 MoE layers, 128 experts, top-8, 4 q / 4 kv heads
inline const char* const kDenseMix = "qwen3moe-tiny-dense-mix";  // layers 0, 1, 3 MoE (16 experts), 2 dense; 2 kv heads
inline const char* const kFp8 = "qwen3moe-tiny-fp8";  // FP8 e4m3 linear weights with 128x128 block scales

// Pass 0: prompts of 5, 1 and 3 tokens; pass 1: one token each. Logits per pass, per sequence.
using PassLogits = std::vector<std::vector<model::HostTensor>>;

inline std::vector<std::vector<std::vector<int32_t>>> schedule() {
  return {{{3, 17, 250, 9, 41}, {200}, {0, 8, 99}}, {{5}, {64}, {255}}};
}

struct Fixture {
  model::Qwen3MoeConfig config;
  PassLogits reference;            // single-rank model
  eplb::LoadMatrix router_counts;  // tokens per (MoE layer, logical expert) over the schedule
};

// The single-rank run of `name` (cached per fixture).
inline const Fixture& fixture(const std::string& name) {
  static std::map<std::string, Fixture> cache;
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  Fixture f;
  f.config = model::load_qwen3_moe_config(golden_model_dir(name));
  backend::CpuBackend cpu;
  model::Qwen3MoeModel qwen(f.config, cpu);
  model::Checkpoint checkpoint(golden_model_dir(name));
  qwen.load_weights(checkpoint);
  const int num_moe_layers = static_cast<int>(f.config.moe_layer_indices().size());
  f.router_counts = eplb::LoadMatrix(num_moe_layers, f.config.num_experts);
  model::ForwardHooks hooks;
  hooks.on_router = [&](int layer_idx, const model::Tensor&, const model::RouterChoice& choice) {
    for (const int32_t e : choice.expert_ids) f.router_counts.at(f.config.moe_layer_ordinal(layer_idx), e) += 1;
  };
  const auto passes = schedule();
  std::vector<model::KvCache> caches;
  for (size_t i = 0; i < passes[0].size(); ++i) caches.push_back(qwen.create_kv_cache(16));
  for (const auto& pass : passes) {
    std::vector<model::SequenceInput> batch;
    for (size_t i = 0; i < pass.size(); ++i) batch.push_back({pass[i], &caches[i]});
    std::vector<model::HostTensor> logits;
    for (const model::Tensor& t : qwen.forward(batch, hooks)) logits.push_back({t.shape(), cpu.download(t)});
    f.reference.push_back(std::move(logits));
  }
  return cache.emplace(name, std::move(f)).first->second;
}

// The schedule on in-process ranks; returns world rank 0's logits and checks every rank got the same.
inline PassLogits run_engine(const std::string& name, const engine::ParallelFlags& flags,
                             const engine::EngineOptions& options, const eplb::Placement* placement = nullptr) {
  const Fixture& f = fixture(name);
  const engine::ParallelLayout layout(flags, f.config);
  std::vector<PassLogits> per_rank(static_cast<size_t>(layout.world_size()));
  comm::run_in_process(layout.world_size(), [&](int rank, comm::Communicator& world) {
    backend::CpuBackend cpu;
    engine::RankEngine engine(f.config, layout, world, cpu, placement, options);
    model::Checkpoint checkpoint(golden_model_dir(name));
    engine.load_weights(checkpoint);
    engine.reset(std::vector<int64_t>(3, 16));
    for (const auto& pass : schedule()) per_rank[rank].push_back(engine.forward(pass));
  });
  for (const PassLogits& other : per_rank) {
    for (size_t p = 0; p < other.size(); ++p) {
      for (size_t i = 0; i < other[p].size(); ++i) EXPECT_EQ(other[p][i].data, per_rank[0][p][i].data);
    }
  }
  return per_rank[0];
}

inline float max_logit_diff(const PassLogits& a, const PassLogits& b) {
  float diff = 0;
  EXPECT_EQ(a.size(), b.size());
  for (size_t p = 0; p < std::min(a.size(), b.size()); ++p) {
    for (size_t i = 0; i < a[p].size(); ++i) {
      EXPECT_EQ(a[p][i].shape, b[p][i].shape);
      EXPECT_EQ(a[p][i].data.size(), b[p][i].data.size());
      for (size_t k = 0; k < std::min(a[p][i].data.size(), b[p][i].data.size()); ++k) {
        diff = std::max(diff, std::abs(a[p][i].data[k] - b[p][i].data[k]));
      }
    }
  }
  return diff;
}

// A placement planned by the fulcrum planner from the fixture's recorded router counts.
inline eplb::Placement planned_placement(const std::string& name, int num_physical_experts, int num_gpus) {
  eplb::PlanOptions options;
  options.topology = eplb::Topology{num_physical_experts, num_gpus, 1};
  return eplb::make_planner("deepseek")->plan(fixture(name).router_counts, options);
}

}  // namespace fulcrum::test
