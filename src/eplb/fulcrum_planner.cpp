// The fulcrum planner: see fulcrum_planner.hpp for the from-scratch plan and fulcrum_migrate.hpp for
// replanning from a current placement.
#include "eplb/fulcrum_planner.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <memory>
#include <numeric>

#include "eplb/fulcrum_layout.hpp"
#include "eplb/fulcrum_migrate.hpp"
#include "eplb/fulcrum_pack.hpp"
#include "eplb/metrics.hpp"
#include "eplb/planner.hpp"

namespace fulcrum::eplb {
namespace {

using fulcrum_detail::Layout;

// Hierarchical mode may exceed the flat plan's max GPU load by this fraction to keep experts on fewer
// nodes; beyond it, it falls back to the flat plan.
constexpr double kHierarchySlack = 0.002;
// The local search stops once the max GPU load is within a fraction of the bound max(W/G, tau): further
// steps cost time for no measurable gain. The fraction follows what the mean balancedness must reach
// (the acceptance levels: 0.9995 at 16 GPUs, 0.998 at 32, i.e. a slack of 5e-4 * (G / 16)^2) and takes
// 0.3 of that slack, never less than kMinSearchTolerance (balancedness >= 0.9998 where W/G is the
// bound) nor more than kMaxSearchTolerance.
constexpr double kMinSearchTolerance = 2e-4;
constexpr double kMaxSearchTolerance = 1e-3;
double search_tolerance(int num_gpus) {
  const double scale = num_gpus / 16.0;
  return std::clamp(0.3 * 5e-4 * scale * scale, kMinSearchTolerance, kMaxSearchTolerance);
}
// A layer whose plan is this far above the lower bound gets the count bisection of plan_flat.
constexpr double kHardLayer = 2e-3;
constexpr int kHardLayerRounds = 8;
constexpr int kRestarts = 8;  // perturbed restarts on hard layers
// Migration stopping rule (see migration_target).
constexpr double kMigrationMargin = 0.001;    // above the reference balancedness
constexpr double kMigrationFloor = 0.99;      // the reference is never below this
constexpr double kMigrationFreshSlack = 5e-4;  // never demand more than fresh - this

struct MigrationTarget {
  double stop_max;      // the search stops once every GPU is at or below this
  double accept_max;    // a search that stalls above stop_max is still taken at or below this
};

// Stopping rule of replanning from a current map. With fresh = the from-scratch fulcrum plan's
// balancedness and deepseek = a from-scratch DeepSeek plan's, the search stops when the layer's
// balancedness reaches min(fresh - kMigrationFreshSlack, max(deepseek, kMigrationFloor) + kMigrationMargin):
// as balanced as a from-scratch replan by the reference algorithm would be (and at least 0.99), plus a
// margin, and no more, since every further slot moved costs a weight copy. A search that stalls
// before is still taken if it reaches max(deepseek, kMigrationFloor) (or the stop level, if lower):
// otherwise the relabelled fresh plan is used.
MigrationTarget migration_target(std::span<const double> expert_load, const PlanOptions& options, double fresh_max) {
  const Topology& topo = options.topology;
  const double mean = std::accumulate(expert_load.begin(), expert_load.end(), 0.0) / topo.num_gpus;
  if (fresh_max <= 0.0 || mean <= 0.0) return {fresh_max, fresh_max};
  static const std::unique_ptr<Planner> reference = make_deepseek_planner();
  thread_local std::vector<int32_t> reference_map;
  reference_map.resize(topo.num_physical_experts);
  reference->plan_layer(expert_load, options, {}, reference_map);
  const double required = std::max(balancedness(gpu_loads(expert_load, reference_map, topo)), kMigrationFloor);
  const double fresh_balance = mean / fresh_max;
  const double stop = std::min(fresh_balance - kMigrationFreshSlack, required + kMigrationMargin);
  const double accept = std::min(stop, required);
  return {stop > 0.0 ? std::max(mean / stop, fresh_max) : fresh_max, accept > 0.0 ? std::max(mean / accept, fresh_max) : fresh_max};
}

// Smallest max GPU load the counts allow: max(W / G, largest load per replica).
double count_bound(const Layout& layout, std::span<const int> counts) {
  double total = 0.0, per_replica = 0.0;
  for (int e = 0; e < layout.num_experts; ++e) {
    total += layout.load[e];
    per_replica = std::max(per_replica, layout.load[e] / counts[e]);
  }
  return std::max(total / layout.num_gpus, per_replica);
}

// Sorts (weight >= 0, expert) pairs, given in expert order, heaviest first with ties by expert: an LSD
// radix sort on a 16-bit float prefix of the weights (stable, so ties keep expert order), then the runs
// of equal prefixes in exact order. A comparison sort of all the keys mispredicts about every other
// comparison and took several times longer.
void sort_heaviest_first(std::vector<std::pair<double, int>>& pairs) {
  const int n = static_cast<int>(pairs.size());
  thread_local std::vector<std::pair<double, int>> moved;
  thread_local std::vector<uint32_t> key, moved_key;
  moved.resize(n);
  key.resize(n);
  moved_key.resize(n);
  // Heavier first = ascending complement of the float's top 16 bits (sign, exponent, 7 mantissa bits:
  // weights within 1% may share one; + 0.0f turns -0.0 into 0), in two passes of 8 bits.
  for (int i = 0; i < n; ++i) key[i] = ~std::bit_cast<uint32_t>(static_cast<float>(pairs[i].first) + 0.0f) >> 16;
  for (int shift = 0; shift < 16; shift += 8) {
    std::array<int, 257> start{};  // start[d + 1] counts digit d, then start[d] is where digit d goes
    for (int i = 0; i < n; ++i) ++start[((key[i] >> shift) & 255) + 1];
    if (n == 0 || start[((key[0] >> shift) & 255) + 1] == n) continue;  // one digit value: no move
    for (int d = 1; d <= 256; ++d) start[d] += start[d - 1];
    for (int i = 0; i < n; ++i) {
      const int at = start[(key[i] >> shift) & 255]++;
      moved_key[at] = key[i];
      moved[at] = pairs[i];
    }
    std::swap(key, moved_key);
    std::swap(pairs, moved);
  }
  // Each run of equal keys in exact order: by insertion when short (the usual case), else by std::sort
  // (near-equal weights in bulk would make insertion quadratic).
  auto heavier = [](const std::pair<double, int>& x, const std::pair<double, int>& y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
  };
  for (int begin = 0, end = 0; begin < n; begin = end) {
    while (end < n && key[end] == key[begin]) ++end;
    if (end - begin > 16) {
      std::sort(pairs.begin() + begin, pairs.begin() + end, heavier);
      continue;
    }
    for (int i = begin + 1; i < end; ++i) {
      const std::pair<double, int> x = pairs[i];
      int j = i;
      for (; j > begin && heavier(x, pairs[j - 1]); --j) pairs[j] = pairs[j - 1];
      pairs[j] = x;
    }
  }
}

// Differencing start improved by the local search; then LPT (DeepSeek's packing, without duplicates):
// if LPT alone is already better, it gets the local search too and replaces the first result. So
// the plan is never less balanced than LPT with the same counts.
void pack_and_search(Layout& layout, Layout& spare, std::span<const int> counts, uint32_t seed = 0) {
  const double tolerance = search_tolerance(layout.num_gpus);
  // Items heaviest first (ties by expert id), the order both packers work in, so they need not sort.
  thread_local std::vector<std::pair<double, int>> experts;
  thread_local std::vector<int> items, order;
  thread_local std::vector<std::pair<double, int>> weighted;  // (replica weight, expert) per item
  experts.clear();
  for (int e = 0; e < layout.num_experts; ++e) experts.emplace_back(layout.load[e] / counts[e], e);
  sort_heaviest_first(experts);
  items.resize(layout.num_slots);
  weighted.resize(layout.num_slots);
  order.clear();
  int next_item = 0;
  for (const auto& [w, e] : experts) {
    order.push_back(e);
    for (int r = 0; r < counts[e]; ++r, ++next_item) {
      items[next_item] = e;
      weighted[next_item] = {w, e};
    }
  }
  // count_bound without its divisions: the largest load per replica heads `experts`.
  double total = 0.0;
  for (int e = 0; e < layout.num_experts; ++e) total += layout.load[e];
  const double lower = std::max(total / layout.num_gpus, experts.empty() ? 0.0 : experts.front().first);
  const double exact = lower * (1.0 + 1e-12);
  const double bound = lower * (1.0 + tolerance);
  fulcrum_detail::differencing_pack(layout, items, counts, 0, layout.num_gpus, seed, weighted);
  layout.rebuild();
  fulcrum_detail::repair_duplicates(layout, 0, layout.num_gpus);
  fulcrum_detail::local_search(layout, 0, layout.num_gpus, bound, true, order);
  if (layout.max_load() <= exact || seed != 0) return;
  spare.reset(layout.load, layout.num_slots, layout.num_gpus);
  bool duplicated = true;
  if (!fulcrum_detail::greedy_pack(spare, items, counts, 0, spare.num_gpus, layout.max_load(), weighted, &duplicated)) {
    return;
  }
  // Without duplicates to repair, the packer's GPU loads are final (summed in slot order, as rebuild
  // would): a losing LPT packing needs no rebuild.
  if (!duplicated && spare.max_load() >= layout.max_load()) return;
  spare.rebuild();
  fulcrum_detail::repair_duplicates(spare, 0, spare.num_gpus);
  if (spare.max_load() >= layout.max_load()) return;
  fulcrum_detail::local_search(spare, 0, spare.num_gpus, bound, true, order);
  // spare's state is current after the search (its moves keep it so): take it whole, no rebuild.
  std::swap(layout.expert, spare.expert);
  std::swap(layout.count, spare.count);
  std::swap(layout.slot_w, spare.slot_w);
  std::swap(layout.gpu_load, spare.gpu_load);
  std::swap(layout.hosted, spare.hosted);
}

// One node: water-filling counts capped at G, packed and searched; hard layers get more tries.
void plan_flat(Layout& layout, Layout& spare) {
  thread_local std::vector<int> counts;
  fulcrum_detail::capped_counts(layout.load, layout.num_slots, layout.cap, counts);
  pack_and_search(layout, spare, counts);
  // Hard layers (well above the bound, typically a few very hot experts): the water-filling counts
  // make many mid-size replicas that pair badly. Bisect on a max load M, with counts ceil(load / M)
  // (spare slots as near-empty fillers), packed and searched; keep the best result.
  const double bound = count_bound(layout, counts);
  if (layout.max_load() <= bound * (1.0 + kHardLayer)) return;
  thread_local Layout trial, trial_spare;
  double lo = bound, hi = layout.max_load();
  for (int round = 0; round < kHardLayerRounds; ++round) {
    const double m = 0.5 * (lo + hi);
    if (!fulcrum_detail::fit_counts(layout.load, layout.num_slots, layout.cap, m, layout.num_gpus, counts)) {
      lo = m;
      continue;
    }
    trial.reset(layout.load, layout.num_slots, layout.num_gpus);
    pack_and_search(trial, trial_spare, counts);
    if (trial.max_load() < layout.max_load()) {
      std::swap(layout.expert, trial.expert);
      layout.rebuild();
    }
    if (trial.max_load() <= m) {
      hi = std::min(m, layout.max_load());
    } else {
      lo = m;
    }
  }
  // Restarts: the water-filling counts packed from perturbed differencing orders.
  fulcrum_detail::capped_counts(layout.load, layout.num_slots, layout.cap, counts);
  for (int round = 0; round < kRestarts && layout.max_load() > bound * (1.0 + search_tolerance(layout.num_gpus)); ++round) {
    trial.reset(layout.load, layout.num_slots, layout.num_gpus);
    pack_and_search(trial, trial_spare, counts, 0x9e3779b9u * (round + 1));
    if (trial.max_load() < layout.max_load()) {
      std::swap(layout.expert, trial.expert);
      layout.rebuild();
    }
  }
}

// Experts onto nodes (heaviest first, whole when a node has room, else split), then a flat plan per node,
// then a global search capped at the flat plan's max GPU load plus kHierarchySlack.
void plan_hierarchical(Layout& layout, Layout& flat, int num_nodes) {
  const int num_gpus = layout.num_gpus, num_experts = layout.num_experts;
  const int gpus_per_node = num_gpus / num_nodes;
  const int node_slots = layout.num_slots / num_nodes;
  thread_local std::vector<int> counts, order, node_free, in_node;
  thread_local std::vector<double> node_load;
  thread_local std::vector<std::vector<int>> node_items;
  fulcrum_detail::capped_counts(layout.load, layout.num_slots, layout.cap, counts);
  order.resize(num_experts);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return layout.load[a] > layout.load[b] || (layout.load[a] == layout.load[b] && a < b);
  });
  node_free.assign(num_nodes, node_slots);
  node_load.assign(num_nodes, 0.0);
  node_items.resize(num_nodes);
  for (auto& items : node_items) items.clear();
  in_node.assign(num_nodes, 0);
  for (int e : order) {
    std::fill(in_node.begin(), in_node.end(), 0);
    const double w = layout.load[e] / counts[e];
    for (int left = counts[e]; left > 0;) {
      // Prefer the lightest node that can take all that is left (up to one replica per GPU of the node);
      // else the node with the most room.
      int whole = -1, roomy = -1;
      for (int n = 0; n < num_nodes; ++n) {
        const int limit = layout.allow_dup ? left : std::min(left, gpus_per_node - in_node[n]);
        if (node_free[n] == 0 || limit == 0) continue;
        if (node_free[n] >= limit && (whole < 0 || node_load[n] < node_load[whole])) whole = n;
        if (roomy < 0 || node_free[n] > node_free[roomy]) roomy = n;
      }
      int n = whole >= 0 ? whole : roomy;
      if (n < 0) {  // every node with room already holds gpus_per_node replicas: accept a duplicate
        n = static_cast<int>(std::max_element(node_free.begin(), node_free.end()) - node_free.begin());
      }
      const int limit = layout.allow_dup || (whole < 0 && roomy < 0) ? left : std::min(left, gpus_per_node - in_node[n]);
      const int take = std::min(limit, node_free[n]);
      node_items[n].insert(node_items[n].end(), take, e);
      node_free[n] -= take;
      node_load[n] += take * w;
      in_node[n] += take;
      left -= take;
    }
  }
  for (int n = 0; n < num_nodes; ++n) {
    fulcrum_detail::differencing_pack(layout, node_items[n], counts, n * gpus_per_node, (n + 1) * gpus_per_node);
  }
  layout.rebuild();
  for (int n = 0; n < num_nodes; ++n) fulcrum_detail::repair_duplicates(layout, n * gpus_per_node, (n + 1) * gpus_per_node);
  const double bound = count_bound(layout, counts);
  for (int n = 0; n < num_nodes; ++n) {
    fulcrum_detail::local_search(layout, n * gpus_per_node, (n + 1) * gpus_per_node, bound * (1.0 + 1e-12), false);
  }
  thread_local Layout spare;
  plan_flat(flat, spare);
  flat.rebuild();
  const double flat_max = flat.max_load();
  fulcrum_detail::local_search(layout, 0, num_gpus, flat_max * (1.0 + kHierarchySlack), true);
  layout.rebuild();
  if (layout.max_load() > flat_max * (1.0 + kHierarchySlack)) {
    std::copy(flat.expert.begin(), flat.expert.end(), layout.expert.begin());
    layout.rebuild();
  }
}

class FulcrumPlanner final : public Planner {
 public:
  std::string_view name() const override { return "fulcrum"; }

  void plan_layer(std::span<const double> expert_load, const PlanOptions& options,
                  std::span<const int32_t> current_map, std::span<int32_t> out_map) const override {
    const Topology& topo = options.topology;
    FULCRUM_CHECK(static_cast<int>(out_map.size()) == topo.num_physical_experts,
                  "output map has {} slots, topology has {}", out_map.size(), topo.num_physical_experts);
    thread_local Layout fresh, other;
    fresh.reset(expert_load, topo.num_physical_experts, topo.num_gpus);
    if (topo.num_nodes > 1) {
      other.reset(expert_load, topo.num_physical_experts, topo.num_gpus);
      plan_hierarchical(fresh, other, topo.num_nodes);
    } else {
      other.reset(expert_load, topo.num_physical_experts, topo.num_gpus);
      plan_flat(fresh, other);
    }
    if (current_map.empty()) {
      std::copy(fresh.expert.begin(), fresh.expert.end(), out_map.begin());
      return;
    }
    FULCRUM_CHECK(current_map.size() == out_map.size(), "current map has {} slots, expected {}", current_map.size(),
                  out_map.size());
    // Two candidates: the fresh plan relabelled onto the current GPUs (same balance as the fresh plan),
    // and a move-by-move search from the current map. The search wins when it reaches the target with
    // fewer changed slots.
    fresh.rebuild();
    thread_local std::vector<int> fresh_counts;
    fresh_counts.assign(fresh.count.begin(), fresh.count.end());
    const MigrationTarget target = migration_target(expert_load, options, fresh.max_load());
    fulcrum_detail::relabel_onto(fresh.expert, current_map, fresh.num_experts, topo.num_gpus, out_map);
    // The relabelled plan has the fresh balance; the undo pass spends the slack down to the target
    // on restoring original experts.
    std::copy(out_map.begin(), out_map.end(), fresh.expert.begin());
    fresh.rebuild();
    const int relabel_moves = fulcrum_detail::undo_unneeded(fresh, current_map, target.stop_max);
    std::copy(fresh.expert.begin(), fresh.expert.end(), out_map.begin());
    other.reset(expert_load, topo.num_physical_experts, topo.num_gpus);
    const int search_moves = fulcrum_detail::descend_from(other, current_map, target.stop_max, relabel_moves - 1);
    other.rebuild();
    int best_moves = relabel_moves;
    if (search_moves < best_moves && other.max_load() <= target.accept_max) {
      std::copy(other.expert.begin(), other.expert.end(), out_map.begin());
      best_moves = search_moves;
    }
    // Third candidate: the fresh plan's counts reached from the current map, then searched.
    other.reset(expert_load, topo.num_physical_experts, topo.num_gpus);
    const int refit_moves = fulcrum_detail::refit_from(other, current_map, fresh_counts, target.stop_max);
    other.rebuild();
    if (refit_moves < best_moves && other.max_load() <= target.accept_max) {
      std::copy(other.expert.begin(), other.expert.end(), out_map.begin());
    }
  }
};

}  // namespace

std::vector<double> node_loads(std::span<const double> expert_load, std::span<const int32_t> layer_map,
                               const Topology& topo) {
  const std::vector<double> per_gpu = gpu_loads(expert_load, layer_map, topo);
  std::vector<double> loads(topo.num_nodes, 0.0);
  for (int g = 0; g < topo.num_gpus; ++g) loads[topo.node_of_gpu(g)] += per_gpu[g];
  return loads;
}

double mean_nodes_per_expert(std::span<const int32_t> layer_map, int num_logical_experts, const Topology& topo) {
  std::vector<char> seen(static_cast<size_t>(num_logical_experts) * topo.num_nodes, 0);
  int64_t distinct = 0;
  for (size_t s = 0; s < layer_map.size(); ++s) {
    char& mark = seen[static_cast<size_t>(layer_map[s]) * topo.num_nodes + topo.node_of_slot(static_cast<int>(s))];
    distinct += mark == 0;
    mark = 1;
  }
  return static_cast<double>(distinct) / num_logical_experts;
}

int max_replicas_on_one_gpu(std::span<const int32_t> layer_map, int num_logical_experts, const Topology& topo) {
  std::vector<int> on_gpu(static_cast<size_t>(num_logical_experts) * topo.num_gpus, 0);
  int most = 0;
  for (size_t s = 0; s < layer_map.size(); ++s) {
    most = std::max(most, ++on_gpu[static_cast<size_t>(layer_map[s]) * topo.num_gpus + topo.gpu_of_slot(static_cast<int>(s))]);
  }
  return most;
}

std::unique_ptr<Planner> make_fulcrum_planner() { return std::make_unique<FulcrumPlanner>(); }

}  // namespace fulcrum::eplb
