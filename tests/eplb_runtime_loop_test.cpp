// The EPLB loop between forward passes: on in-process EP ranks with synthetic slots (rebalances start
// migrations that advance one layer per pass, slots always match the live placement, every rank agrees),
// and on the tiny Qwen3-MoE model (recording hooks count the routing; migrating its slots step by step
// between forward passes leaves the logits bitwise unchanged).
#include <gtest/gtest.h>

#include <random>

#include "backend/cpu/cpu_backend.hpp"
#include "comm/in_process_communicator.hpp"
#include "eplb/error.hpp"
#include "eplb_runtime/eplb_runtime.hpp"
#include "eplb_runtime/recording_hooks.hpp"
#include "eplb_runtime_test_util.hpp"
#include "model/qwen3_config.hpp"
#include "model/safetensors.hpp"
#include "model_test_util.hpp"

namespace fulcrum::eplb_runtime {
namespace {

using test::make_rank_slots;
using test::slot_holds;

// Routing of one rank in one pass: the hot experts move with the pass number, so loads drift.
std::vector<int32_t> synthetic_routing(int rank, int pass, int moe_layer_idx, int num_experts) {
  std::vector<int32_t> ids;
  const int hot = (pass / 4 + moe_layer_idx) % num_experts;
  for (int t = 0; t < 40; ++t) ids.push_back(t % 2 == 0 ? hot : (t * 7 + rank + moe_layer_idx) % num_experts);
  ids.push_back(-1);  // a padded token
  return ids;
}

TEST(EplbRuntimeLoop, RebalancesAndMigratesLayerByLayerBetweenPasses) {
  const int num_ranks = 2, num_layers = 3, num_experts = 8, num_passes = 24;
  const eplb::Topology topo{10, num_ranks, 1};
  std::vector<std::vector<eplb::Placement>> live_per_pass(num_ranks);
  std::vector<int> num_rebalances(num_ranks), num_switches(num_ranks), num_mixed_passes(num_ranks);
  comm::run_in_process(num_ranks, [&](int rank, comm::Communicator& comm) {
    backend::CpuBackend backend;
    ManagerOptions manager_options;
    manager_options.rebalance_num_iterations = 4;
    manager_options.log = [](const std::string&) {};
    EplbManager manager(eplb::trivial_placement(topo, num_layers, num_experts), manager_options);
    ExpertRecorder recorder({RecorderMode::kStat, 4, num_layers, num_experts, {}, 1});
    test::RankSlots slots = make_rank_slots(backend, manager.placement(), rank, {0, 1, 2});
    BackendSlotCopyExecutor executor(backend, comm);
    EplbRuntime runtime(recorder, manager, slots.views, executor, comm, comm, {1, 0});
    for (int pass = 0; pass < num_passes; ++pass) {
      // "Forward pass": route and record; dispatch would read runtime.live_placement() here.
      for (int l = 0; l < num_layers; ++l) recorder.record(l, synthetic_routing(rank, pass, l, num_experts));
      const PassOutcome outcome = runtime.after_forward_pass();
      if (outcome.rebalance && !outcome.rebalance->skipped) ++num_rebalances[rank];
      EXPECT_LE(outcome.switched_layers.size(), 1u);
      num_switches[rank] += static_cast<int>(outcome.switched_layers.size());
      // The next pass runs on a partly migrated model: some layers switched, others not yet.
      num_mixed_passes[rank] += !outcome.switched_layers.empty() && runtime.migrating();
      const eplb::Placement& live = runtime.live_placement();
      live.validate();
      check_same_placement(live, comm);
      // The slots hold exactly what the live placement says, on every layer.
      for (const auto& view : slots.views) {
        for (int s = 0; s < view.num_slots; ++s) {
          const int expected = live.layer(view.moe_layer_idx)[rank * topo.slots_per_gpu() + s];
          ASSERT_EQ(view.physical_to_logical[s], expected);
          ASSERT_TRUE(slot_holds(backend, view, s, expected)) << "pass " << pass << " layer " << view.moe_layer_idx;
        }
      }
      live_per_pass[rank].push_back(live);
    }
    // Drain: with no further rebalance due, the migration completes and live == the manager's target.
    while (runtime.migrating()) runtime.after_forward_pass();
    EXPECT_EQ(runtime.live_placement().physical_to_logical_map, manager.placement().physical_to_logical_map);
    EXPECT_LE(runtime.migration_totals().peak_staging_bytes,
              topo.slots_per_gpu() * test::slot_bytes_of_synthetic());
  });
  EXPECT_GE(num_rebalances[0], 2);
  EXPECT_GE(num_switches[0], 3);
  EXPECT_EQ(num_rebalances[0], num_rebalances[1]);
  EXPECT_GT(num_mixed_passes[0], 0);
  EXPECT_EQ(num_mixed_passes[0], num_mixed_passes[1]);
  for (int pass = 1; pass < num_passes; ++pass) {
    int rows_changed = 0;
    for (int l = 0; l < num_layers; ++l) {
      const auto a = live_per_pass[0][pass - 1].layer(l), b = live_per_pass[0][pass].layer(l);
      rows_changed += !std::equal(a.begin(), a.end(), b.begin());
    }
    EXPECT_LE(rows_changed, 2);  // one step, or one step plus the rest of a migration finished early
  }
}

TEST(EplbRuntimeLoop, TinyModelLogitsUnchangedWhileItsSlotsMigrate) {
  const std::string dir = fulcrum::test::golden_model_dir("qwen3moe-tiny-dense-mix");  // MoE layers 0, 1, 3
  const auto config = model::load_qwen3_moe_config(dir);
  const int num_experts = config.num_experts, num_moe_layers = 3;
  backend::CpuBackend cpu;
  model::Checkpoint checkpoint(dir);
  const eplb::Topology topo{num_experts + 4, 1, 1};
  const eplb::Placement start = eplb::trivial_placement(topo, num_moe_layers, num_experts);
  model::Qwen3MoeModel reference(config, cpu), migrating(config, cpu, {}, &start);
  reference.load_weights(checkpoint);
  migrating.load_weights(checkpoint);

  ExpertRecorder recorder({RecorderMode::kPerToken, 8, num_moe_layers, num_experts, {}, config.num_experts_per_tok});
  const auto views = migrating.expert_slot_views();
  std::vector<int32_t> reference_ids;  // every routing choice the reference model made, in order
  model::ForwardHooks reference_hooks;
  reference_hooks.on_router = [&](int, const model::Tensor&, const model::RouterChoice& choice) {
    reference_ids.insert(reference_ids.end(), choice.expert_ids.begin(), choice.expert_ids.end());
  };
  const model::ForwardHooks hooks = make_recording_hooks(recorder, views);

  std::mt19937 rng(4);
  const eplb::Placement target = test::random_placement(rng, topo, num_moe_layers, num_experts);
  comm::run_in_process(1, [&](int, comm::Communicator& comm) {
    BackendSlotCopyExecutor executor(cpu, comm);
    PlacementMigration migration(start, target, views, executor, comm, {1, 0});
    const std::vector<int32_t> prompt = {3, 17, 250, 9, 41};
    for (int pass = 0; pass < 5; ++pass) {
      model::KvCache ref_cache = reference.create_kv_cache(8), cache = migrating.create_kv_cache(8);
      const std::vector<model::SequenceInput> ref_batch = {{prompt, &ref_cache}}, batch = {{prompt, &cache}};
      const auto expected = reference.forward(ref_batch, reference_hooks);
      const auto logits = migrating.forward(batch, hooks);
      recorder.end_pass();
      EXPECT_EQ(cpu.download(logits[0]), cpu.download(expected[0])) << "pass " << pass;
      migration.step();  // one MoE layer switches between passes
    }
    EXPECT_TRUE(migration.done());
  });
  for (const auto& view : views) {
    const auto row = target.layer(view.moe_layer_idx);
    EXPECT_TRUE(std::equal(row.begin(), row.end(), view.physical_to_logical.begin()));
  }
  // The recorder saw exactly the reference's routing: 5 tokens x top_k per MoE layer per pass.
  const eplb::LoadMatrix loads = recorder.window_loads();
  for (int l = 0; l < num_moe_layers; ++l) {
    double total = 0.0;
    for (const double v : loads.layer(l)) total += v;
    EXPECT_EQ(total, 5.0 * 5 * config.num_experts_per_tok);
  }
  std::vector<int32_t> recorded_ids;
  for (const auto& pass : recorder.pass_token_expert_ids()) {
    for (const auto& ids : pass) recorded_ids.insert(recorded_ids.end(), ids.begin(), ids.end());
  }
  std::sort(recorded_ids.begin(), recorded_ids.end());
  std::sort(reference_ids.begin(), reference_ids.end());
  EXPECT_EQ(recorded_ids, reference_ids);
}

TEST(EplbRuntimeLoop, HooksRefuseLayersWithoutAView) {
  const auto config = model::load_qwen3_moe_config(fulcrum::test::golden_model_dir("qwen3moe-tiny-dense-mix"));
  backend::CpuBackend cpu;
  model::Qwen3MoeModel stage(config, cpu, {2, 4});  // owns decoder layers 2 (dense) and 3 (MoE layer 2)
  const auto views = stage.expert_slot_views();
  ExpertRecorder only_first({RecorderMode::kStat, 2, 3, config.num_experts, {0, 1}, 0});
  EXPECT_THROW(make_recording_hooks(only_first, views), Error);
  ExpertRecorder recorder({RecorderMode::kStat, 2, 3, config.num_experts, {2}, 0});
  const model::ForwardHooks hooks = make_recording_hooks(recorder, views);
  model::RouterChoice choice;
  choice.top_k = 1;
  choice.expert_ids = {5, 5, 7};
  hooks.on_router(3, model::Tensor(), choice);
  EXPECT_THROW(hooks.on_router(2, model::Tensor(), choice), Error);
  recorder.end_pass();
  EXPECT_EQ(recorder.window_loads().at(2, 5), 2.0);
  EXPECT_EQ(recorder.window_loads().at(0, 5), 0.0);
}

}  // namespace
}  // namespace fulcrum::eplb_runtime
