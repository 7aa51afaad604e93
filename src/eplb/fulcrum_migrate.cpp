#include "eplb/fulcrum_migrate.hpp"

#include <algorithm>
#include <limits>
#include <vector>

#include "eplb/fulcrum_pack.hpp"
#include "eplb/fulcrum_search.hpp"

namespace fulcrum::eplb::fulcrum_detail {
namespace {

// Minimum-cost perfect assignment on an n x n matrix (row-major), Hungarian method with potentials,
// O(n^3). Returns col_of_row.
void min_cost_assignment(const std::vector<int>& cost, int n, std::vector<int>& col_of_row) {
  constexpr int kInf = std::numeric_limits<int>::max() / 4;
  thread_local std::vector<int> u, v, row_of_col, way, min_slack;
  thread_local std::vector<char> used;
  u.assign(n + 1, 0);
  v.assign(n + 1, 0);
  row_of_col.assign(n + 1, 0);  // 1-based; column 0 is a virtual start
  way.assign(n + 1, 0);
  for (int row = 1; row <= n; ++row) {
    row_of_col[0] = row;
    int col0 = 0;
    min_slack.assign(n + 1, kInf);
    used.assign(n + 1, 0);
    do {
      used[col0] = 1;
      const int row0 = row_of_col[col0];
      int delta = kInf, col1 = 0;
      for (int col = 1; col <= n; ++col) {
        if (used[col]) continue;
        const int slack = cost[(row0 - 1) * n + (col - 1)] - u[row0] - v[col];
        if (slack < min_slack[col]) {
          min_slack[col] = slack;
          way[col] = col0;
        }
        if (min_slack[col] < delta) {
          delta = min_slack[col];
          col1 = col;
        }
      }
      for (int col = 0; col <= n; ++col) {
        if (used[col]) {
          u[row_of_col[col]] += delta;
          v[col] -= delta;
        } else {
          min_slack[col] -= delta;
        }
      }
      col0 = col1;
    } while (row_of_col[col0] != 0);
    do {  // augment along the path
      const int col1 = way[col0];
      row_of_col[col0] = row_of_col[col1];
      col0 = col1;
    } while (col0 != 0);
  }
  col_of_row.assign(n, 0);
  for (int col = 1; col <= n; ++col) col_of_row[row_of_col[col] - 1] = col - 1;
}

}  // namespace

int slots_changed(std::span<const int32_t> a, std::span<const int32_t> b) {
  int changed = 0;
  for (size_t i = 0; i < a.size(); ++i) changed += a[i] != b[i];
  return changed;
}

void relabel_onto(std::span<const int32_t> fresh, std::span<const int32_t> current, int num_experts,
                  int num_gpus, std::span<int32_t> out) {
  const int per_gpu = static_cast<int>(fresh.size()) / num_gpus;
  thread_local std::vector<int> cost, match, multiplicity;
  thread_local std::vector<char> kept;
  multiplicity.assign(num_experts, 0);
  cost.assign(static_cast<size_t>(num_gpus) * num_gpus, 0);
  kept.assign(per_gpu, 0);
  for (int i = 0; i < num_gpus; ++i) {
    for (int s = i * per_gpu; s < (i + 1) * per_gpu; ++s) ++multiplicity[fresh[s]];
    for (int j = 0; j < num_gpus; ++j) {  // overlap = size of the multiset intersection
      int overlap = 0;
      for (int k = 0; k < per_gpu; ++k) {
        const int e = current[j * per_gpu + k];
        kept[k] = multiplicity[e] > 0;
        if (kept[k]) {
          --multiplicity[e];
          ++overlap;
        }
      }
      for (int k = 0; k < per_gpu; ++k) {
        if (kept[k]) ++multiplicity[current[j * per_gpu + k]];
      }
      cost[static_cast<size_t>(i) * num_gpus + j] = per_gpu - overlap;
    }
    for (int s = i * per_gpu; s < (i + 1) * per_gpu; ++s) multiplicity[fresh[s]] = 0;
  }
  min_cost_assignment(cost, num_gpus, match);
  for (int i = 0; i < num_gpus; ++i) {
    const int j = match[i];
    for (int s = i * per_gpu; s < (i + 1) * per_gpu; ++s) ++multiplicity[fresh[s]];
    for (int k = 0; k < per_gpu; ++k) {  // common experts stay in their current slot
      const int e = current[j * per_gpu + k];
      kept[k] = multiplicity[e] > 0;
      if (kept[k]) {
        --multiplicity[e];
        out[j * per_gpu + k] = e;
      }
    }
    int k = 0;
    for (int s = i * per_gpu; s < (i + 1) * per_gpu; ++s) {  // the rest fill the freed slots in order
      const int e = fresh[s];
      if (multiplicity[e] == 0) continue;
      --multiplicity[e];
      while (kept[k]) ++k;
      out[j * per_gpu + k++] = e;
    }
  }
}

int descend_from(Layout& layout, std::span<const int32_t> current, double target_max, int max_moves) {
  std::copy(current.begin(), current.end(), layout.expert.begin());
  layout.rebuild();
  // A current map may hold two replicas of an expert on one GPU (e.g. one made by deepseek); give each
  // extra replica to the expert with the highest load per replica that the GPU lacks (one move each).
  if (!layout.allow_dup) {
    for (int s = 0; s < layout.num_slots; ++s) {
      const int g = layout.gpu_of(s), e = layout.expert[s];
      if (layout.on(e, g) < 2) continue;
      int best = -1;
      for (int a = 0; a < layout.num_experts; ++a) {
        if (layout.on(a, g) != 0 || layout.count[a] >= layout.cap) continue;
        if (best < 0 || layout.load[a] / (layout.count[a] + 1) > layout.load[best] / (layout.count[best] + 1)) best = a;
      }
      if (best >= 0) layout.reassign(s, best);
    }
  }
  int changed = excess_descent(layout, current, target_max, target_max, max_moves);
  // Where the excess descent stalls, moves aimed at the heaviest GPU alone may still help.
  MoveFinder finder(layout, 0, layout.num_gpus, current.data());
  const int max_steps = 4 * layout.num_slots;
  for (int step = 0; step < max_steps && changed <= max_moves; ++step) {
    const int h = layout.heaviest();
    if (layout.gpu_load[h] <= target_max) break;
    const Move move = finder.best_reassign(h, finder.best_swap(h));
    if (!move.valid()) break;
    finder.apply(move);
    changed = slots_changed(layout.expert, current);
  }
  // Still above: the from-scratch local search (pair swaps included) from here, blind to moves; the
  // undo pass below then restores what it changed needlessly.
  if (layout.max_load() > target_max && changed <= max_moves) {
    local_search(layout, 0, layout.num_gpus, target_max, true);
    changed = slots_changed(layout.expert, current);
  }
  if (layout.max_load() <= target_max) changed = undo_unneeded(layout, current, target_max);
  return changed;
}

int refit_from(Layout& layout, std::span<const int32_t> current, std::span<const int> counts, double target_max) {
  std::copy(current.begin(), current.end(), layout.expert.begin());
  layout.rebuild();
  const int slots = layout.num_slots, experts = layout.num_experts;
  thread_local std::vector<int> have, freed;
  have.assign(layout.count.begin(), layout.count.end());
  freed.clear();
  // Surplus replicas leave, those on the most loaded GPUs (under the new loads) first.
  for (bool more = true; more;) {
    more = false;
    int pick = -1;
    for (int s = 0; s < slots; ++s) {
      const int e = layout.expert[s];
      if (e < 0 || have[e] <= counts[e]) continue;
      if (pick < 0 || layout.gpu_load[layout.gpu_of(s)] > layout.gpu_load[layout.gpu_of(pick)]) pick = s;
    }
    if (pick >= 0) {
      const int e = layout.expert[pick];
      --have[e];
      layout.gpu_load[layout.gpu_of(pick)] -= layout.slot_w[pick];
      --layout.hosted[static_cast<size_t>(e) * layout.num_gpus + layout.gpu_of(pick)];
      layout.expert[pick] = -1;
      freed.push_back(pick);
      more = true;
    }
  }
  // Missing replicas, heaviest first, into the freed slot of the lightest GPU that lacks the expert.
  thread_local std::vector<std::pair<double, int>> missing;
  missing.clear();
  for (int e = 0; e < experts; ++e) {
    for (int k = have[e]; k < counts[e]; ++k) missing.emplace_back(layout.load[e] / counts[e], e);
  }
  std::sort(missing.begin(), missing.end(), [](const auto& x, const auto& y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
  });
  for (const auto& [w, e] : missing) {
    int best = -1;
    for (size_t i = 0; i < freed.size(); ++i) {
      const int s = freed[i];
      if (s < 0) continue;
      const int g = layout.gpu_of(s);
      const bool clash = !layout.allow_dup && layout.on(e, g) != 0;
      if (best < 0) {
        best = static_cast<int>(i);
        continue;
      }
      const int gb = layout.gpu_of(freed[best]);
      const bool best_clash = !layout.allow_dup && layout.on(e, gb) != 0;
      if (clash != best_clash ? !clash : layout.gpu_load[g] < layout.gpu_load[gb]) best = static_cast<int>(i);
    }
    const int s = freed[best];
    freed[best] = -1;
    layout.expert[s] = e;
    layout.gpu_load[layout.gpu_of(s)] += w;
    ++layout.hosted[static_cast<size_t>(e) * layout.num_gpus + layout.gpu_of(s)];
  }
  layout.rebuild();
  repair_duplicates(layout, 0, layout.num_gpus);
  excess_descent(layout, current, target_max, target_max, slots);
  if (layout.max_load() > target_max) local_search(layout, 0, layout.num_gpus, target_max, true);
  return layout.max_load() <= target_max ? undo_unneeded(layout, current, target_max) : slots_changed(layout.expert, current);
}

int undo_unneeded(Layout& layout, std::span<const int32_t> origin, double target_max) {
  // Greedy undo: restore a changed slot's original expert (or swap two changed slots back) whenever the
  // layout then still has every GPU <= target_max and no GPU holds an expert twice.
  const int slots = layout.num_slots;
  auto fits = [&] { return layout.max_load() <= target_max; };
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < slots; ++s) {
      const int now = layout.expert[s], was = origin[s];
      if (now == was) continue;
      const int g = layout.gpu_of(s);
      // Swap back with a slot of another GPU that holds `was` and originally held `now`.
      int partner = -1;
      for (int t = 0; t < slots && partner < 0; ++t) {
        if (layout.expert[t] == was && origin[t] == now && layout.gpu_of(t) != g) partner = t;
      }
      if (partner >= 0 && (layout.allow_dup || (layout.on(was, g) == 0 && layout.on(now, layout.gpu_of(partner)) == 0))) {
        layout.swap_slots(s, partner);
        if (fits()) {
          progress = true;
          continue;
        }
        layout.swap_slots(s, partner);
      }
      if (layout.count[now] < 2 || layout.count[was] >= layout.cap || (!layout.allow_dup && layout.on(was, g) != 0)) continue;
      layout.reassign(s, was);
      if (fits()) {
        progress = true;
      } else {
        layout.reassign(s, now);
      }
    }
  }
  return slots_changed(layout.expert, origin);
}

}  // namespace fulcrum::eplb::fulcrum_detail
