// The GPU MoE layer's CPU reference (src/model/moe_reference.hpp) against the code whose semantics it
// stands for: the engine's replica choice (engine::ReplicaChooser, static, dynamic and balanced), the model's MoE
// block operations (CpuBackend route / expert_mlp / weighted_sum), and plain invariants (slot offsets,
// an expert with no token). These run everywhere; tests_cuda/moe_layer_test.cpp compares the GPU with it.
#include <algorithm>
#include <cmath>
#include <numeric>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "engine/replica_choice.hpp"
#include "eplb/error.hpp"
#include "model/model_parallel.hpp"
#include "model/moe_reference.hpp"
#include "moe_test_util.hpp"

namespace fulcrum::test {
namespace {

namespace moe = model::moe;

// 16 experts on 4 GPUs with 4 replicas: expert 0 in slots 0, 3, 19; experts 1 and 2 twice; expert 3 in slot 16.
std::vector<int32_t> replicated_map() {
  std::vector<int32_t> map(20);
  std::iota(map.begin(), map.begin() + 16, 0);
  map[16] = 0, map[17] = 1, map[18] = 2, map[19] = 0;
  std::swap(map[3], map[16]);  // a replica of expert 0 on GPU 0, expert 3 on GPU 3
  return map;
}

TEST(MoeReference, ReplicaChoiceMatchesEngine) {
  const std::vector<int32_t> map = replicated_map();
  const eplb::Topology topo{20, 4, 1};
  const int num_experts = 16, top_k = 4;
  const int64_t num_tokens = 37, per_source = 10;  // the last source has 7 tokens
  const std::vector<float> logits = random_bf16_values(num_tokens * num_experts, 3, 4.0f);
  const model::RouterChoice choice = moe::route_reference(logits, num_tokens, num_experts, top_k, true);
  const uint64_t seed = 42, pass_idx = 5;
  const int moe_layer_idx = 2;
  for (const auto algorithm :
       {eplb::DispatchAlgorithm::kStatic, eplb::DispatchAlgorithm::kDynamic, eplb::DispatchAlgorithm::kBalanced}) {
    SCOPED_TRACE(std::string(eplb::to_string(algorithm)));
    std::vector<uint64_t> streams;
    for (int s = 0; s < 4; ++s) streams.push_back(engine::dynamic_dispatch_stream(seed, pass_idx, moe_layer_idx, s));
    const moe::ReplicaChoiceSpec spec = moe::make_replica_choice(
        algorithm, map, num_experts, topo, per_source,
        algorithm == eplb::DispatchAlgorithm::kDynamic ? streams : std::vector<uint64_t>{});
    const std::vector<int32_t> slots = moe::choose_slots_reference(choice, spec);
    // The engine: each source's entries, a token's experts ascending, through ReplicaChooser.
    engine::ReplicaChooser chooser(algorithm, seed, 4, 1);
    chooser.set_layer(moe_layer_idx, map, num_experts, topo);
    std::vector<int64_t> counts(4 * num_experts, 0);  // [source][expert], what balanced splits
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int j = 0; j < top_k; ++j) ++counts[(t / per_source) * num_experts + choice.expert_ids[t * top_k + j]];
    }
    chooser.begin_pass(pass_idx, counts);
    for (int source = 0; source < 4; ++source) {
      std::vector<int32_t> experts, entries;
      for (int64_t t = source * per_source; t < std::min(num_tokens, (source + 1) * per_source); ++t) {
        std::vector<int> order(top_k);
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](int a, int b) { return choice.expert_ids[t * top_k + a] < choice.expert_ids[t * top_k + b]; });
        for (const int j : order) {
          experts.push_back(choice.expert_ids[t * top_k + j]);
          entries.push_back(static_cast<int32_t>(t * top_k + j));
        }
      }
      std::vector<int32_t> engine_slots(experts.size());
      chooser.choose(source, experts, engine_slots);
      for (size_t i = 0; i < entries.size(); ++i) EXPECT_EQ(slots[entries[i]], engine_slots[i]) << "entry " << entries[i];
    }
    for (size_t e = 0; e < slots.size(); ++e) EXPECT_EQ(map[slots[e]], choice.expert_ids[e]);
  }
}

TEST(MoeReference, DynamicChoiceSpreadsOverReplicas) {
  const std::vector<int32_t> map = replicated_map();
  const int64_t num_tokens = 4000;
  std::vector<float> logits = random_bf16_values(num_tokens * 16, 4, 1.0f);
  for (int64_t t = 0; t < num_tokens; ++t) logits[t * 16] = 10.0f;  // expert 0 (3 replicas) always chosen
  const model::RouterChoice choice = moe::route_reference(logits, num_tokens, 16, 4, true);
  const moe::ReplicaChoiceSpec spec = moe::make_replica_choice(eplb::DispatchAlgorithm::kDynamic, map, 16,
                                                               eplb::Topology{20, 4, 1}, 1000, {1, 2, 3, 4});
  const std::vector<int32_t> slots = moe::choose_slots_reference(choice, spec);
  std::vector<int> per_slot(20, 0);
  for (size_t e = 0; e < slots.size(); ++e) {
    if (choice.expert_ids[e] == 0) ++per_slot[slots[e]];
  }
  for (const int s : {0, 3, 19}) EXPECT_NEAR(per_slot[s], num_tokens / 3.0, 150) << "slot " << s;  // ~5 sigma
}

TEST(MoeReference, BadTablesAreRejected) {
  const std::vector<int32_t> map = replicated_map();
  std::vector<int32_t> bad_map = map;
  bad_map[5] = 16;  // no such expert
  EXPECT_THROW(moe::make_replica_choice(eplb::DispatchAlgorithm::kBalanced, bad_map, 16, eplb::Topology{20, 4, 1}, 8),
               Error);
  EXPECT_THROW(moe::make_replica_choice(eplb::DispatchAlgorithm::kDynamic, map, 16, eplb::Topology{20, 4, 1}, 8, {1}),
               Error);
  EXPECT_THROW(moe::make_replica_choice(eplb::DispatchAlgorithm::kStatic, map, 16, eplb::Topology{20, 4, 1}, 0), Error);
}

TEST(MoeReference, SlotLayoutCountsAndOffsets) {
  const moe::SlotLayout layout = moe::slot_layout_reference(std::vector<int32_t>{4, 0, 4, 2, 4}, 6);
  EXPECT_EQ(layout.counts, (std::vector<int32_t>{1, 0, 1, 0, 3, 0}));
  EXPECT_EQ(layout.offsets, (std::vector<int32_t>{0, 1, 1, 2, 2, 5, 5}));
  EXPECT_THROW(moe::slot_layout_reference(std::vector<int32_t>{6}, 6), Error);
}

// The layer reference vs the model's fp32 MoE block ops, and independent of which replica computes.
TEST(MoeReference, LayerMatchesModelOpsAndIgnoresReplicaChoice) {
  const int hidden = 24, inter = 10, experts = 16, top_k = 4;
  const int64_t num_tokens = 19;
  const std::vector<int32_t> map = replicated_map();
  const std::vector<float> logical_gate_up = random_bf16_values(int64_t{experts} * 2 * inter * hidden, 5, 0.3f);
  const std::vector<float> logical_down = random_bf16_values(int64_t{experts} * hidden * inter, 6, 0.3f);
  std::vector<float> gate_up, down;
  for (const int32_t e : map) {
    gate_up.insert(gate_up.end(), logical_gate_up.begin() + e * 2 * inter * hidden, logical_gate_up.begin() + (e + 1) * 2 * inter * hidden);
    down.insert(down.end(), logical_down.begin() + e * hidden * inter, logical_down.begin() + (e + 1) * hidden * inter);
  }
  const std::vector<float> x = random_bf16_values(num_tokens * hidden, 7, 1.0f);
  const std::vector<float> logits = random_bf16_values(num_tokens * experts, 8, 3.0f);
  const eplb::Topology topo{20, 4, 1};
  const auto spec_static = moe::make_replica_choice(eplb::DispatchAlgorithm::kStatic, map, experts, topo, 5);
  const auto spec_dynamic = moe::make_replica_choice(eplb::DispatchAlgorithm::kDynamic, map, experts, topo, 5, {9, 8, 7, 6});
  const std::vector<float> out = moe::moe_layer_reference(x, logits, num_tokens, gate_up, down, hidden, inter, top_k,
                                                          true, spec_static);
  EXPECT_EQ(out, moe::moe_layer_reference(x, logits, num_tokens, gate_up, down, hidden, inter, top_k, true, spec_dynamic));
  const auto spec_balanced = moe::make_replica_choice(eplb::DispatchAlgorithm::kBalanced, map, experts, topo, 5);
  EXPECT_EQ(out, moe::moe_layer_reference(x, logits, num_tokens, gate_up, down, hidden, inter, top_k, true, spec_balanced));

  backend::CpuBackend cpu;
  const model::RouterChoice choice = moe::route_reference(logits, num_tokens, experts, top_k, true);
  const model::Tensor rows = cpu.zeros({num_tokens * top_k, int64_t{hidden}});
  std::vector<float> all_rows;
  for (int64_t e = 0; e < num_tokens * top_k; ++e) {
    const int expert = choice.expert_ids[e];
    const model::Tensor xs = cpu.zeros({1, int64_t{hidden}}), gu = cpu.zeros({2 * inter, hidden}), dn = cpu.zeros({hidden, inter});
    cpu.upload(xs, std::span(x).subspan((e / top_k) * hidden, hidden));
    cpu.upload(gu, std::span(logical_gate_up).subspan(expert * 2 * inter * hidden, 2 * inter * hidden));
    cpu.upload(dn, std::span(logical_down).subspan(expert * hidden * inter, hidden * inter));
    const std::vector<float> y = cpu.download(model::expert_mlp(cpu, xs, gu, dn));
    all_rows.insert(all_rows.end(), y.begin(), y.end());
  }
  cpu.upload(rows, all_rows);
  const std::vector<float> expected = cpu.download(cpu.weighted_sum(rows, choice.weights, top_k));
  const double error = relative_error(out, expected);
  EXPECT_LE(error, 1e-2);  // bf16 intermediates vs fp32 (tests_cuda/moe_layer_test.cpp says why)
  EXPECT_GT(error, 0.0);   // the reference does round to bf16

  // combine_reference on the model's own rows is the model's weighted sum.
  std::vector<int32_t> identity(static_cast<size_t>(num_tokens * top_k));
  std::iota(identity.begin(), identity.end(), 0);
  const std::vector<float> combined = moe::combine_reference(all_rows, identity, choice.weights, num_tokens, top_k, hidden);
  for (size_t i = 0; i < combined.size(); ++i) EXPECT_NEAR(combined[i], expected[i], 1e-6f);
}

}  // namespace
}  // namespace fulcrum::test
