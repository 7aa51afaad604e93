// Placements and the EPLB seam: 1000 random valid placements swapped into live engines between forward
// passes (replace_layer_placement) keep the single-rank logits; the routing hook reports every token once
// per MoE layer with the slot that computed it, and both dispatch backends choose the same replicas.
#include <mutex>

#include <gtest/gtest.h>

#include "engine_test_util.hpp"

namespace fulcrum::test {
namespace {

// A random valid layer map: every expert once, then `num_slots - num_experts` random extra replicas, shuffled.
std::vector<int32_t> random_layer_map(eplb::SplitMix64& rng, int num_experts, int num_slots) {
  std::vector<int32_t> map(static_cast<size_t>(num_slots));
  for (int s = 0; s < num_slots; ++s) map[s] = s < num_experts ? s : static_cast<int32_t>(rng.below(num_experts));
  for (int s = num_slots - 1; s > 0; --s) std::swap(map[s], map[rng.below(static_cast<uint32_t>(s + 1))]);
  return map;
}

struct PropertyCase {
  engine::ParallelFlags flags;
  const char* backend;
  eplb::DispatchAlgorithm algorithm;
};

TEST(EnginePlacement, RandomPlacementsSwappedBetweenPassesKeepTheLogits) {
  const Fixture& f = fixture(k128e);
  const int num_moe_layers = static_cast<int>(f.config.moe_layer_indices().size());
  const auto flags = [](int tp, int dp, int ep, int redundant) {
    engine::ParallelFlags x;
    x.tp = tp, x.dp = dp, x.ep = ep, x.enable_dp_attention = dp > 1, x.num_redundant_experts = redundant;
    return x;
  };
  const std::vector<PropertyCase> cases = {
      {flags(2, 1, 2, 2), "alltoall", eplb::DispatchAlgorithm::kStatic},
      {flags(2, 2, 2, 6), "allgather", eplb::DispatchAlgorithm::kBalanced},
      {flags(4, 2, 4, 4), "alltoall", eplb::DispatchAlgorithm::kBalanced},
      {flags(4, 1, 4, 12), "allgather", eplb::DispatchAlgorithm::kDynamic},
  };
  constexpr int kPlacementsPerCase = 250;
  const auto prefill = schedule()[0];
  int checked = 0;
  float worst = 0;
  for (const PropertyCase& c : cases) {
    const engine::ParallelLayout layout(c.flags, f.config);
    const int num_slots = layout.num_physical_experts();
    eplb::SplitMix64 rng(0xC0FFEEu + static_cast<uint64_t>(num_slots));
    std::vector<std::vector<std::vector<int32_t>>> maps(kPlacementsPerCase);  // [placement][MoE layer][P]
    for (auto& placement : maps) {
      for (int l = 0; l < num_moe_layers; ++l) placement.push_back(random_layer_map(rng, f.config.num_experts, num_slots));
    }
    std::vector<float> diffs(kPlacementsPerCase, -1.0f);
    engine::EngineOptions options;
    options.moe_a2a_backend = c.backend;
    options.dispatch_algorithm = c.algorithm;
    comm::run_in_process(layout.world_size(), [&](int rank, comm::Communicator& world) {
      backend::CpuBackend cpu;
      engine::RankEngine engine(f.config, layout, world, cpu, nullptr, options);
      model::Checkpoint checkpoint(golden_model_dir(k128e));
      engine.load_weights(checkpoint);
      for (int p = 0; p < kPlacementsPerCase; ++p) {
        for (int l = 0; l < num_moe_layers; ++l) engine.replace_layer_placement(l, maps[p][l], checkpoint);
        engine.reset(std::vector<int64_t>(prefill.size(), 8));
        const PassLogits logits = {engine.forward(prefill)};
        if (rank == 0) diffs[p] = max_logit_diff(logits, {f.reference[0]});
      }
    });
    for (int p = 0; p < kPlacementsPerCase; ++p) {
      EXPECT_LE(diffs[p], 1e-5f) << c.backend << " " << eplb::to_string(c.algorithm) << " placement " << p;
      worst = std::max(worst, diffs[p]);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 1000);
  std::printf("[ layout   ] 1000 random placements on EP 2/4: max |logit diff| %.3g\n", worst);
}

// The migration seam: a rank writes its slots through expert_slot_views, then every rank commits the same
// new map (here each EP rank swaps its first two slots, weights and map entries).
TEST(EnginePlacement, CommitAfterSlotsWrittenInPlace) {
  const Fixture& f = fixture(k128e);
  engine::ParallelFlags flags;
  flags.tp = 2, flags.ep = 2, flags.num_redundant_experts = 2;
  const engine::ParallelLayout layout(flags, f.config);
  const eplb::Placement placement = planned_placement(k128e, 130, 2);
  float diff = -1;
  comm::run_in_process(2, [&](int rank, comm::Communicator& world) {
    backend::CpuBackend cpu;
    engine::RankEngine engine(f.config, layout, world, cpu, &placement, {});
    model::Checkpoint checkpoint(golden_model_dir(k128e));
    engine.load_weights(checkpoint);
    for (const model::ExpertSlotView& view : engine.model().expert_slot_views()) {
      for (const model::Tensor& slots : {view.gate_up, view.down}) {
        const model::Tensor first = cpu.zeros(slots.index(0).shape());
        cpu.copy(first, slots.index(0));
        cpu.copy(slots.index(0), slots.index(1));
        cpu.copy(slots.index(1), first);
      }
      std::vector<int32_t> map(view.layer_map.begin(), view.layer_map.end());
      for (int ep_rank = 0; ep_rank < 2; ++ep_rank) std::swap(map[ep_rank * 65], map[ep_rank * 65 + 1]);
      engine.commit_layer_placement(view.moe_layer_idx, map);
    }
    engine.reset(std::vector<int64_t>(3, 16));
    PassLogits logits;
    for (const auto& pass : schedule()) logits.push_back(engine.forward(pass));
    if (rank == 0) diff = max_logit_diff(logits, f.reference);
  });
  EXPECT_GE(diff, 0.0f);
  EXPECT_LE(diff, 1e-5f);
}

// (pass, MoE layer, source) -> (experts, slots), from every rank's hook.
using Records = std::map<std::tuple<uint64_t, int, int>, std::pair<std::vector<int32_t>, std::vector<int32_t>>>;

Records record_routing(const engine::ParallelFlags& flags, const char* backend, eplb::DispatchAlgorithm algorithm,
                       const eplb::Placement* placement) {
  Records records;
  std::mutex mutex;
  engine::EngineOptions options;
  options.moe_a2a_backend = backend;
  options.dispatch_algorithm = algorithm;
  options.on_routing = [&](const engine::RoutingRecord& r) {
    std::lock_guard lock(mutex);
    auto& entry = records[{r.pass_idx, r.moe_layer_idx, r.source}];
    EXPECT_TRUE(entry.first.empty()) << "a source reported twice";
    entry.first.assign(r.expert_ids.begin(), r.expert_ids.end());
    entry.second.assign(r.slot_ids.begin(), r.slot_ids.end());
  };
  run_engine(k128e, flags, options, placement);
  return records;
}

TEST(EnginePlacement, RoutingHookSeesEveryTokenOnceAndBackendsAgreeOnReplicas) {
  const Fixture& f = fixture(k128e);
  engine::ParallelFlags flags;
  flags.tp = 4, flags.dp = 2, flags.ep = 4, flags.enable_dp_attention = true, flags.num_redundant_experts = 8;
  const eplb::Placement placement = planned_placement(k128e, 136, 4);
  const int top_k = f.config.num_experts_per_tok;
  for (const auto algorithm : {eplb::DispatchAlgorithm::kStatic, eplb::DispatchAlgorithm::kDynamic,
                               eplb::DispatchAlgorithm::kBalanced}) {
    const Records gathered = record_routing(flags, "allgather", algorithm, &placement);
    const Records routed = record_routing(flags, "alltoall", algorithm, &placement);
    EXPECT_EQ(gathered, routed) << eplb::to_string(algorithm);
    // Per pass and MoE layer: every token's top-k once over all sources, each entry at a slot holding its expert.
    std::map<std::pair<uint64_t, int>, std::vector<int64_t>> counts;  // -> [num_experts]
    for (const auto& [key, value] : gathered) {
      const auto& [pass, moe_layer, source] = key;
      auto& c = counts[{pass, moe_layer}];
      c.resize(static_cast<size_t>(f.config.num_experts));
      ASSERT_EQ(value.first.size(), value.second.size());
      for (size_t i = 0; i < value.first.size(); ++i) {
        ++c[value.first[i]];
        EXPECT_EQ(placement.layer(moe_layer)[value.second[i]], value.first[i]);
        if (algorithm == eplb::DispatchAlgorithm::kStatic) {  // a local replica is always preferred
          const int ep_rank = source;                           // one rank per EP rank here
          const auto map = placement.layer(moe_layer);
          const bool has_local = std::find(map.begin() + ep_rank * 34, map.begin() + (ep_rank + 1) * 34,
                                           value.first[i]) != map.begin() + (ep_rank + 1) * 34;
          if (has_local) {
            EXPECT_EQ(value.second[i] / 34, ep_rank);
          }
        }
      }
    }
    const std::vector<int64_t> tokens_per_pass = {9, 3};
    for (const auto& [key, c] : counts) {
      int64_t expected = 0;
      for (int e = 0; e < f.config.num_experts; ++e) expected += c[e];
      EXPECT_EQ(expected, tokens_per_pass[key.first] * top_k);
    }
    // The prefill counts are the single-rank router's.
    for (int l = 0; l < 3; ++l) {
      double total = 0;
      for (int e = 0; e < f.config.num_experts; ++e) total += static_cast<double>(counts[{0, l}][e] + counts[{1, l}][e]);
      for (int e = 0; e < f.config.num_experts; ++e) {
        EXPECT_EQ(static_cast<double>(counts[{0, l}][e] + counts[{1, l}][e]), f.router_counts.at(l, e));
      }
      EXPECT_EQ(total, 12.0 * top_k);
    }
  }
}

}  // namespace
}  // namespace fulcrum::test
