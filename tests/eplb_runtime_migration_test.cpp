// Slot migration on in-process EP ranks with synthetic slot tensors whose values encode
// (MoE layer, logical expert, element), so every check is exact: final contents, writes only to changed
// slots, each slot received once, staging bounded by one layer's slots of a rank, and after every step
// each layer fully old or fully new. Then a fuzz over random placements (EP 1/2/4, P = E or E + R).
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "backend/cpu/cpu_backend.hpp"
#include "comm/in_process_communicator.hpp"
#include "eplb/error.hpp"
#include "eplb/migration_plan.hpp"
#include "eplb_runtime/slot_migration.hpp"
#include "eplb_runtime_test_util.hpp"

namespace fulcrum::eplb_runtime {
namespace {

using namespace test;

// Wraps the backend executor and counts what reaches each slot and staging entry.
class CountingExecutor final : public SlotCopyExecutor {
 public:
  CountingExecutor(model::Backend& backend, comm::Communicator& comm) : inner_(backend, comm) {}
  void begin_layer(const model::ExpertSlotView& view, int n) override {
    staging_fills_.assign(static_cast<size_t>(n), 0);
    inner_.begin_layer(view, n);
  }
  void copy_local(const model::ExpertSlotView& view, int src, int staging_idx) override {
    ++staging_fills_.at(static_cast<size_t>(staging_idx));
    inner_.copy_local(view, src, staging_idx);
  }
  void send(const model::ExpertSlotView& view, int src, int dst_rank) override { inner_.send(view, src, dst_rank); }
  void recv(const model::ExpertSlotView& view, int staging_idx, int src_rank) override {
    ++staging_fills_.at(static_cast<size_t>(staging_idx));
    inner_.recv(view, staging_idx, src_rank);
  }
  void wait() override { inner_.wait(); }
  void commit_slot(const model::ExpertSlotView& view, int staging_idx, int dst) override {
    if (staging_fills_.at(static_cast<size_t>(staging_idx)) != 1) ++bad_staging_fills;
    ++slot_writes[{view.moe_layer_idx, dst}];
    inner_.commit_slot(view, staging_idx, dst);
  }
  void end_layer() override { inner_.end_layer(); }
  int64_t peak_staging_bytes() const override { return inner_.peak_staging_bytes(); }

  std::map<std::pair<int, int>, int> slot_writes;  // (MoE layer, local slot) -> commits
  int bad_staging_fills = 0;                       // staging entries not filled exactly once

 private:
  BackendSlotCopyExecutor inner_;
  std::vector<int> staging_fills_;
};

struct Case {
  eplb::Placement from, to;
  std::vector<int> owned_layers;  // every rank's stage owns these
  MigrationOptions options;
};

// Runs one migration on G in-process ranks and checks everything; returns the number of steps taken.
int64_t run_case(const Case& c) {
  const eplb::Topology& topo = c.from.topology;
  const int slots_per_rank = topo.slots_per_gpu();
  std::vector<int64_t> steps(topo.num_gpus);
  comm::run_in_process(topo.num_gpus, [&](int rank, comm::Communicator& comm) {
    backend::CpuBackend backend;
    RankSlots slots = make_rank_slots(backend, c.from, rank, c.owned_layers);
    CountingExecutor executor(backend, comm);
    PlacementMigration migration(c.from, c.to, slots.views, executor, comm, c.options);
    auto check_layers = [&](const eplb::Placement& live) {
      for (size_t v = 0; v < slots.views.size(); ++v) {
        const auto& view = slots.views[v];
        const int l = view.moe_layer_idx;
        const auto live_row = live.layer(l), old_row = c.from.layer(l), new_row = c.to.layer(l);
        const bool is_old = std::equal(live_row.begin(), live_row.end(), old_row.begin());
        const bool is_new = std::equal(live_row.begin(), live_row.end(), new_row.begin());
        ASSERT_TRUE(is_old || is_new) << "layer " << l << " is half switched";
        for (int s = 0; s < slots_per_rank; ++s) {
          const int expected = live_row[rank * slots_per_rank + s];
          ASSERT_EQ(view.physical_to_logical[s], expected) << "layer " << l << " slot " << s;
          ASSERT_TRUE(slot_holds(backend, view, s, expected)) << "layer " << l << " slot " << s;
        }
      }
    };
    while (!migration.done()) {
      const std::vector<int> switched = migration.step();
      EXPECT_FALSE(switched.empty());
      EXPECT_LE(static_cast<int>(switched.size()), c.options.layers_per_step);
      comm.barrier();
      check_layers(migration.live_placement());
    }
    EXPECT_TRUE(migration.step().empty());
    // Final: owned layers fully new; unowned rows of the live placement untouched.
    for (int l = 0; l < c.from.num_layers; ++l) {
      const bool owned = std::find(c.owned_layers.begin(), c.owned_layers.end(), l) != c.owned_layers.end();
      const auto live_row = migration.live_placement().layer(l);
      const auto expected = owned ? c.to.layer(l) : c.from.layer(l);
      EXPECT_TRUE(std::equal(live_row.begin(), live_row.end(), expected.begin())) << "layer " << l;
    }
    check_layers(migration.live_placement());
    // Writes: exactly the changed slots, once each.
    int64_t num_changed = 0;
    for (const int l : c.owned_layers) {
      for (int s = 0; s < slots_per_rank; ++s) {
        const int global = rank * slots_per_rank + s;
        const bool changed = c.from.layer(l)[global] != c.to.layer(l)[global];
        num_changed += changed;
        const auto it = executor.slot_writes.find({l, s});
        EXPECT_EQ(it == executor.slot_writes.end() ? 0 : it->second, changed ? 1 : 0) << "layer " << l << " slot " << s;
      }
    }
    EXPECT_EQ(executor.bad_staging_fills, 0);
    const MigrationStats& stats = migration.stats();
    EXPECT_EQ(stats.num_local_copies + stats.num_received, num_changed);
    EXPECT_LE(stats.peak_staging_bytes, slots_per_rank * (2 * kWidth * kHidden + kHidden * kWidth) * 4);
    steps[rank] = stats.num_steps;
  });
  for (const int64_t s : steps) EXPECT_EQ(s, steps[0]);
  return steps[0];
}

TEST(EplbRuntimeMigration, SwapsAcrossRanksWithRedundantSlots) {
  // E = 4, P = 6 on 2 ranks: rank 0 holds slots 0-2, rank 1 slots 3-5.
  const eplb::Topology topo{6, 2, 1};
  eplb::Placement from(topo, 2, 4), to(topo, 2, 4);
  from.physical_to_logical_map = {0, 1, 2, 3, 0, 1, /**/ 0, 1, 2, 3, 3, 3};
  to.physical_to_logical_map = {3, 1, 0, 2, 0, 1, /**/ 0, 1, 2, 3, 3, 3};  // layer 1 unchanged
  Case c{from, to, {0, 1}, {}};
  EXPECT_EQ(run_case(c), 1);  // one changed layer, one step
}

TEST(EplbRuntimeMigration, StepsFollowLayersPerStepAndTheByteBudget) {
  std::mt19937 rng(1);
  const eplb::Topology topo{8, 2, 1};
  Case c{random_placement(rng, topo, 5, 6), random_placement(rng, topo, 5, 6), {0, 1, 2, 3, 4}, {}};
  const eplb::MigrationPlan plan = eplb::plan_migration(c.from, c.to);
  int num_changed_layers = 0;
  for (int l = 0; l < 5; ++l) {
    num_changed_layers += std::any_of(plan.transfers.begin(), plan.transfers.end(),
                                      [l](const eplb::SlotTransfer& t) { return t.layer_idx == l; });
  }
  c.options.layers_per_step = 1;
  EXPECT_EQ(run_case(c), num_changed_layers);
  c.options.layers_per_step = 100;
  EXPECT_EQ(run_case(c), 1);
  c.options.max_bytes_per_step = 1;  // smaller than any layer: still one layer per step
  EXPECT_EQ(run_case(c), num_changed_layers);
}

TEST(EplbRuntimeMigration, PipelineStageMigratesOnlyItsLayers) {
  std::mt19937 rng(2);
  const eplb::Topology topo{12, 4, 2};
  Case c{random_placement(rng, topo, 4, 10), random_placement(rng, topo, 4, 10), {1, 3}, {}};
  run_case(c);
}

TEST(EplbRuntimeMigration, RejectsViewsThatDisagreeWithTheOldPlacement) {
  const eplb::Topology topo{4, 2, 1};
  const eplb::Placement from = eplb::trivial_placement(topo, 1, 4);
  eplb::Placement to = from;
  std::swap(to.layer(0)[0], to.layer(0)[3]);
  EXPECT_THROW(comm::run_in_process(2,
                                    [&](int rank, comm::Communicator& comm) {
                                      backend::CpuBackend backend;
                                      RankSlots slots = make_rank_slots(backend, from, rank, {0});
                                      slots.maps[0][0] = 3 - slots.maps[0][0];
                                      BackendSlotCopyExecutor executor(backend, comm);
                                      PlacementMigration migration(from, to, slots.views, executor, comm);
                                    }),
               Error);
  EXPECT_THROW(comm::run_in_process(1,
                                    [&](int, comm::Communicator& comm) {  // 2-rank placement on 1 rank
                                      backend::CpuBackend backend;
                                      BackendSlotCopyExecutor executor(backend, comm);
                                      PlacementMigration migration(from, to, {}, executor, comm);
                                    }),
               Error);
}

TEST(EplbRuntimeMigration, FuzzRandomPlacements) {
  std::mt19937 rng(12345);
  int num_cases = 0;
  for (const int num_gpus : {1, 2, 4}) {
    for (int trial = 0; trial < 80; ++trial) {
      const int num_experts = num_gpus * std::uniform_int_distribution<int>(1, 3)(rng);
      const int num_redundant = num_gpus * std::uniform_int_distribution<int>(0, 2)(rng);
      const int num_layers = std::uniform_int_distribution<int>(1, 3)(rng);
      const eplb::Topology topo{num_experts + num_redundant, num_gpus, num_gpus >= 2 && trial % 2 ? 2 : 1};
      Case c{random_placement(rng, topo, num_layers, num_experts), eplb::Placement(), {}, {}};
      // Half the cases: a small perturbation of `from` (few moves), half: an unrelated placement.
      c.to = trial % 2 ? random_placement(rng, topo, num_layers, num_experts) : c.from;
      if (trial % 2 == 0) {
        for (int l = 0; l < num_layers; ++l) {
          auto row = c.to.layer(l);
          std::swap(row[std::uniform_int_distribution<int>(0, topo.num_physical_experts - 1)(rng)],
                    row[std::uniform_int_distribution<int>(0, topo.num_physical_experts - 1)(rng)]);
        }
      }
      for (int l = 0; l < num_layers; ++l) {
        if (trial % 3 != 0 || l % 2 == 0) c.owned_layers.push_back(l);
      }
      c.options.layers_per_step = std::uniform_int_distribution<int>(1, 2)(rng);
      run_case(c);
      ++num_cases;
      if (HasFailure()) return;
    }
  }
  EXPECT_EQ(num_cases, 240);
}

}  // namespace
}  // namespace fulcrum::eplb_runtime
