#include "eplb/fulcrum_pack.hpp"

#include <algorithm>
#include <cmath>

#include "eplb/fulcrum_search.hpp"

namespace fulcrum::eplb::fulcrum_detail {

void capped_counts(std::span<const double> load, int slots, int cap, std::vector<int>& counts) {
  const int num_experts = static_cast<int>(load.size());
  counts.assign(num_experts, 1);
  const int extra = slots - num_experts;
  if (extra <= 0 || cap <= 1) return;
  // Each further slot goes to the highest key (load / count, then lower index), so the slots handed
  // out are the `extra` highest of the keys load[e] / j, j = 1 .. cap - 1. Phase 1 hands out at once
  // every key above a threshold lambda (they outrank all others), with lambda chosen so that at most
  // `extra` are; phase 2 hands out the rest one by one in key order.
  const int64_t most = static_cast<int64_t>(cap) - 1;
  auto above = [&](int e, double lambda, double inverse) -> int64_t {  // #{j in [1, most] : load[e] / j > lambda}
    if (!(load[e] > lambda)) return 0;
    const double t = load[e] * inverse;  // load / lambda within a few ulps
    const double whole = std::floor(t);
    int64_t j = static_cast<int64_t>(std::min(static_cast<double>(most), whole));
    // Away from an integer, floor(t) is the count and the exact (division) checks below would not move
    // it: skip their divisions.
    const double margin = 1e-9 * (1.0 + t);
    if (t - whole > margin && (whole + 1.0 - t > margin || j == most)) return j;
    while (j > 0 && !(load[e] / static_cast<double>(j) > lambda)) --j;
    while (j < most && load[e] / static_cast<double>(j + 1) > lambda) ++j;
    return j;
  };
  double total = 0.0;
  for (double x : load) total += x;
  double best_lambda = -1.0;
  int64_t best_given = 0;
  thread_local std::vector<int> trial, kept;
  trial.resize(num_experts);
  kept.resize(num_experts);
  if (total > 0.0) {
    // Experts above lambda get about load / lambda - 1/2 keys above it: solve for lambda over them.
    double lambda = total / (extra + 0.5 * num_experts);
    for (int iter = 0; iter < 6; ++iter) {
      const double inverse = 1.0 / lambda;
      int64_t given = 0;
      int num_heavy = 0;
      for (int e = 0; e < num_experts; ++e) {
        const int64_t a = above(e, lambda, inverse);
        trial[e] = static_cast<int>(a);
        given += a;
        num_heavy += a > 0;
      }
      if (given <= extra && given > best_given) {
        best_given = given;
        best_lambda = lambda;
        std::swap(trial, kept);  // the best lambda's keys per expert, not recomputed afterwards
      }
      if ((given <= extra && extra - given <= 8) || num_heavy == 0) break;
      lambda *= (static_cast<double>(given) + 0.5 * num_heavy) / (extra + 0.5 * num_heavy);
    }
  }
  if (best_lambda > 0.0) {
    for (int e = 0; e < num_experts; ++e) counts[e] += kept[e];
  }
  int left = extra - static_cast<int>(best_given);
  if (left <= 16) {
    // Few left: each to the highest key by a scan of the keys (computed once; -1 marks an expert at cap).
    thread_local std::vector<double> key;
    key.resize(num_experts);
    for (int e = 0; e < num_experts; ++e) key[e] = counts[e] >= cap ? -1.0 : load[e] / counts[e];
    for (; left > 0; --left) {
      int pick = -1;
      double best = -1.0;
      for (int e = 0; e < num_experts; ++e) {
        if (key[e] > best) {
          pick = e;
          best = key[e];
        }
      }
      if (pick < 0) return;
      ++counts[pick];
      key[pick] = counts[pick] >= cap ? -1.0 : load[pick] / counts[pick];
    }
    return;
  }
  // Many left: a max-heap of (load per replica, expert), larger load first, then lower index.
  thread_local std::vector<std::pair<double, int>> heap;
  heap.clear();
  auto less = [](const std::pair<double, int>& a, const std::pair<double, int>& b) {
    return a.first < b.first || (a.first == b.first && a.second > b.second);
  };
  for (int e = 0; e < num_experts; ++e) {
    if (counts[e] < cap) heap.emplace_back(load[e] / counts[e], e);
  }
  std::make_heap(heap.begin(), heap.end(), less);
  // The top expert takes a replica; its key shrinks in place and sinks (one sift instead of pop + push).
  for (; left > 0 && !heap.empty(); --left) {
    const int e = heap.front().second;
    ++counts[e];
    if (counts[e] >= cap) {
      std::pop_heap(heap.begin(), heap.end(), less);
      heap.pop_back();
      continue;
    }
    const std::pair<double, int> key(load[e] / counts[e], e);
    const size_t n = heap.size();
    size_t i = 0;
    for (;;) {
      size_t child = 2 * i + 1;
      if (child >= n) break;
      if (child + 1 < n && less(heap[child], heap[child + 1])) ++child;
      if (!less(key, heap[child])) break;
      heap[i] = heap[child];
      i = child;
    }
    heap[i] = key;
  }
}

bool fit_counts(std::span<const double> load, int slots, int cap, double item_cap, int num_gpus,
                std::vector<int>& counts) {
  const int num_experts = static_cast<int>(load.size());
  counts.resize(num_experts);
  thread_local std::vector<std::pair<double, int>> splits;  // (extra slots per big replica removed, expert)
  splits.clear();
  int used = 0, big = 0;
  for (int e = 0; e < num_experts; ++e) {
    const double need = item_cap > 0.0 ? std::ceil(load[e] / item_cap - 1e-9) : 1.0;
    counts[e] = static_cast<int>(std::clamp(need, 1.0, static_cast<double>(cap)));
    used += counts[e];
    if (load[e] / counts[e] > 0.5 * item_cap) {  // "big": at most one fits a GPU
      big += counts[e];
      const int small = static_cast<int>(std::ceil(2.0 * load[e] / item_cap - 1e-9));
      if (small <= cap) splits.emplace_back(static_cast<double>(small - counts[e]) / counts[e], e);
    }
  }
  // More big replicas than GPUs: split the experts that cost the fewest extra slots into small ones.
  std::sort(splits.begin(), splits.end());
  for (size_t i = 0; big > num_gpus && i < splits.size(); ++i) {
    const int e = splits[i].second;
    const int small = static_cast<int>(std::ceil(2.0 * load[e] / item_cap - 1e-9));
    big -= counts[e];
    used += small - counts[e];
    counts[e] = small;
  }
  if (used > slots) return false;
  // Leftover slots split the small experts further, largest replica first (water-filling among the
  // experts whose replicas are at most M / 2): fine-grained replicas fill the room the big ones leave.
  thread_local std::vector<std::pair<double, int>> heap;
  heap.clear();
  auto less = [](const std::pair<double, int>& a, const std::pair<double, int>& b) {
    return a.first < b.first || (a.first == b.first && a.second > b.second);
  };
  for (int e = 0; e < num_experts; ++e) {
    if (counts[e] < cap && load[e] / counts[e] <= 0.5 * item_cap) heap.emplace_back(load[e] / counts[e], e);
  }
  std::make_heap(heap.begin(), heap.end(), less);
  for (; used < slots && !heap.empty(); ++used) {
    std::pop_heap(heap.begin(), heap.end(), less);
    const int e = heap.back().second;
    heap.pop_back();
    ++counts[e];
    if (counts[e] < cap) {
      heap.emplace_back(load[e] / counts[e], e);
      std::push_heap(heap.begin(), heap.end(), less);
    }
  }
  return used == slots;
}

bool greedy_pack(Layout& layout, std::span<const int> items, std::span<const int> counts, int g0, int g1,
                 double abort_at, std::span<const std::pair<double, int>> weighted, bool* duplicated) {
  const int per_gpu = layout.slots_per_gpu;
  thread_local std::vector<std::pair<double, int>> own;
  thread_local std::vector<int> fill, room, holders;
  std::span<const std::pair<double, int>> order = weighted;
  if (order.size() != items.size()) {
    own.clear();
    for (int e : items) own.emplace_back(layout.load[e] / counts[e], e);
    // Heaviest first; replicas of one expert stay together (ties by expert id).
    auto heavier = [](const auto& x, const auto& y) {
      return x.first > y.first || (x.first == y.first && x.second < y.second);
    };
    if (!std::is_sorted(own.begin(), own.end(), heavier)) std::sort(own.begin(), own.end(), heavier);
    order = own;
  }
  fill.assign(layout.num_gpus, 0);
  for (int g = g0; g < g1; ++g) layout.gpu_load[g] = 0.0;
  // GPUs with room, lightest first (lowest index on ties); a placement only raises one GPU's load, so
  // that GPU moves back to its place (or leaves once full).
  room.clear();
  for (int g = g0; g < g1; ++g) room.push_back(g);
  auto before = [&](int x, int y) {
    return layout.gpu_load[x] < layout.gpu_load[y] || (layout.gpu_load[x] == layout.gpu_load[y] && x < y);
  };
  // Replicas of an expert are consecutive in `order`, so the GPUs holding the current expert so far
  // (`holders`) are the only ones a replica could duplicate on.
  auto holds = [&](int g) { return std::find(holders.begin(), holders.end(), g) != holders.end(); };
  holders.clear();
  int current = -1;
  bool forced = false;
  for (const auto& [w, e] : order) {
    if (e != current) {
      holders.clear();
      current = e;
    }
    // The lightest GPU with room that lacks e; if all with room hold it, the lightest with room.
    const int n = static_cast<int>(room.size());
    int k = 0;
    if (!layout.allow_dup) {
      while (k < n && holds(room[k])) ++k;
      if (k == n) {  // every GPU with room holds e already (repair_duplicates fixes it afterwards)
        k = 0;
        forced = true;
      }
    }
    const int best = room[k];
    holders.push_back(best);
    const int slot = best * per_gpu + fill[best]++;
    layout.expert[slot] = e;
    layout.slot_w[slot] = w;
    layout.gpu_load[best] += w;
    if (!forced && layout.gpu_load[best] >= abort_at) return false;
    if (fill[best] == per_gpu) {
      room.erase(room.begin() + k);
    } else {
      const int at = static_cast<int>(std::upper_bound(room.begin() + k + 1, room.end(), best, before) - room.begin());
      std::copy(room.begin() + k + 1, room.begin() + at, room.begin() + k);
      room[at - 1] = best;
    }
  }
  if (duplicated != nullptr) *duplicated = forced;
  return true;
}

void repair_duplicates(Layout& layout, int g0, int g1) {
  if (layout.allow_dup) return;
  const int per_gpu = layout.slots_per_gpu;
  for (int g = g0; g < g1; ++g) {
    for (int s = g * per_gpu; s < (g + 1) * per_gpu; ++s) {
      const int e = layout.expert[s];
      if (layout.on(e, g) < 2) continue;
      int best_t = -1;
      double best_diff = 0.0;
      for (int t = g0 * per_gpu; t < g1 * per_gpu; ++t) {
        const int k = t / per_gpu, x = layout.expert[t];
        if (k == g || layout.on(e, k) != 0 || layout.on(x, g) != 0) continue;
        const double diff = std::abs(layout.slot_w[t] - layout.slot_w[s]);
        if (best_t < 0 || diff < best_diff) {
          best_t = t;
          best_diff = diff;
        }
      }
      if (best_t >= 0) layout.swap_slots(s, best_t);
    }
  }
}

void local_search(Layout& layout, int g0, int g1, double stop_max, bool reassign,
                  std::span<const int> heaviest_first) {
  MoveFinder finder(layout, g0, g1, nullptr);
  finder.build_index(heaviest_first);
  const int max_steps = 8 * layout.num_slots + 64;
  const double* load = layout.gpu_load.data();
  for (int step = 0; step < max_steps; ++step) {
    // Heaviest GPU (lowest index on ties) and the lightest load in one pass: with h the heaviest, the
    // lightest of the others is the lightest of all (h is only the lightest if all loads are equal).
    int h = g0;
    double heaviest = load[g0], lightest = load[g0];
    for (int g = g0 + 1; g < g1; ++g) {  // selects, not branches: the heaviest's position is unpredictable
      h = load[g] > heaviest ? g : h;
      heaviest = std::max(heaviest, load[g]);
      lightest = std::min(lightest, load[g]);
    }
    if (load[h] <= stop_max) return;
    if (g1 - g0 < 2) lightest = std::numeric_limits<double>::infinity();
    // Cheapest first: swaps, then pair swaps, then reassigns. A move that brings h (and its partner) to
    // stop_max or below is taken as soon as it is found: the best one would only go further below the
    // target at the cost of scanning every candidate.
    const double enough = load[h] - stop_max;
    Move move = finder.best_swap_indexed(h, lightest, enough);
    if (!move.valid()) move = finder.best_pair_swap(h, enough);
    if (!move.valid() && reassign) move = finder.best_reassign(h);
    if (!move.valid()) return;
    finder.apply(move);
  }
}

}  // namespace fulcrum::eplb::fulcrum_detail
