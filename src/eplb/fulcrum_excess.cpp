// Excess descent for migration-aware replanning: with a target max GPU load T, the excess of a layout
// is sum over GPUs of max(0, load - T). Each step applies the move with the largest excess reduction
// per slot changed against the current map (a move that restores an original expert counts half):
//   reassign  slot s (expert b, count >= 2) -> expert a: b's other replicas grow, a's shrink;
//   swap      two slots on different GPUs exchange experts (2 moves).
// Only moves touching a GPU above T are tried: a slot on such a GPU, or an expert it holds gaining a
// replica. Every step lowers the excess by a positive amount, so the descent terminates; it stops at
// zero excess (every GPU <= T), when nothing lowers it, or past the move budget.
#include <algorithm>
#include <vector>

#include "eplb/fulcrum_migrate.hpp"

namespace fulcrum::eplb::fulcrum_detail {

int excess_descent(Layout& L, std::span<const int32_t> origin, double stop, double target, int max_moves) {
  const int E = L.num_experts, G = L.num_gpus, per_gpu = L.slots_per_gpu;
  const double eps = 1e-12 * target;
  auto exc = [target](double x) { return x > target ? x - target : 0.0; };
  auto slot_cost = [&](int s, int e) {
    return static_cast<int>(e != origin[s]) - static_cast<int>(L.expert[s] != origin[s]);
  };
  auto divisor = [](int cost) { return cost > 0 ? static_cast<double>(cost) : 0.5; };
  thread_local std::vector<double> grown, drop, loss_gain, grow_gain;
  thread_local std::vector<int> relieving;  // experts held by a GPU above T
  thread_local std::vector<int> by_grown;   // experts by the weight of one more replica, lightest first
  thread_local std::vector<char> over, relieves_e;
  grown.resize(E);
  drop.resize(E);
  loss_gain.resize(E);
  grow_gain.resize(E);
  over.resize(G);
  relieves_e.resize(E);
  int changed = slots_changed(L.expert, origin);
  bool counts_changed = true;
  for (int step = 0; step < 4 * L.num_slots && changed <= max_moves; ++step) {
    if (L.max_load() <= stop) break;
    for (int g = 0; g < G; ++g) over[g] = L.gpu_load[g] > target;
    // Per expert: excess change over all its GPUs if it loses a replica (each grows by drop[e]) or
    // gains one (each shrinks to grown[e]).
    relieving.clear();
    for (int e = 0; e < E; ++e) {
      const double w = L.replica_w(e);
      grown[e] = L.load[e] / (L.count[e] + 1);
      drop[e] = L.count[e] >= 2 ? L.load[e] / (L.count[e] - 1) - w : 0.0;
      double lose = 0.0, gain = 0.0;
      bool relieves = false;
      const uint16_t* row = L.hosted.data() + static_cast<size_t>(e) * G;
      for (int k = 0; k < G; ++k) {
        if (row[k] == 0) continue;
        const double base = exc(L.gpu_load[k]);
        lose += exc(L.gpu_load[k] + row[k] * drop[e]) - base;
        gain += exc(L.gpu_load[k] - row[k] * (w - grown[e])) - base;
        relieves |= over[k] != 0;
      }
      loss_gain[e] = lose;
      grow_gain[e] = gain;
      relieves_e[e] = relieves && L.count[e] < L.cap;
      if (relieves_e[e]) relieving.push_back(e);
    }
    std::sort(relieving.begin(), relieving.end(), [&](int x, int y) {
      return grow_gain[x] < grow_gain[y] || (grow_gain[x] == grow_gain[y] && x < y);
    });
    if (counts_changed) {  // grown[] depends on the counts only: swaps keep the order
      by_grown.resize(E);
      for (int e = 0; e < E; ++e) by_grown[e] = e;
      std::sort(by_grown.begin(), by_grown.end(), [&](int x, int y) {
        return grown[x] < grown[y] || (grown[x] == grown[y] && x < y);
      });
      counts_changed = false;
    }
    int kind = 0, first = -1, second = -1;  // 1 = reassign (slot, expert), 2 = swap (slot, slot)
    double best = 0.0;
    for (int s = 0; s < L.num_slots; ++s) {
      const int g = L.gpu_of(s), b = L.expert[s];
      const double load_g = L.gpu_load[g], exc_g = exc(load_g);
      if (L.count[b] >= 2) {
        const int on_b = L.on(b, g);
        // b's other GPUs, and g without this replica (b's other replicas on g grow).
        const double others = loss_gain[b] - (exc(load_g + on_b * drop[b]) - exc_g);
        const double rest_g = load_g - L.slot_w[s] + (on_b - 1) * drop[b];
        auto consider = [&](int a) {
          if (a == b || L.count[a] >= L.cap || (!L.allow_dup && L.on(a, g) != 0)) return;
          const double change = others + grow_gain[a] + exc(rest_g + grown[a]) - exc_g;
          if (-change <= eps) return;
          const double score = -change / divisor(slot_cost(s, a));
          if (score > best) {
            best = score;
            kind = 1;
            first = s;
            second = a;
          }
        };
        // Relieving experts by relief, largest first: gain <= exc_g - others - grow_gain[a], and the
        // divisor is the same for every new expert of slot s, so the scan stops at the first that
        // cannot beat the best.
        const double div_s = divisor(slot_cost(s, b == origin[s] ? -1 : origin[s]));
        for (int a : relieving) {
          if ((exc_g - others - grow_gain[a]) / div_s <= best) break;
          consider(a);
        }
        if (over[g]) {
          // Experts outside `relieving` gain nothing elsewhere, and the divisor is the same for every
          // new expert of slot s: the lightest new replica that is allowed is the best of them.
          for (int a : by_grown) {
            if (relieves_e[a] || a == b || L.count[a] >= L.cap || (!L.allow_dup && L.on(a, g) != 0)) continue;
            consider(a);
            break;
          }
        }
      }
    }
    for (int s = 0; s < L.num_slots; ++s) {
      const int g = L.gpu_of(s);
      if (!over[g]) continue;
      // Swaps of this slot (on a GPU above T) with a slot of another GPU: they lower the excess by at
      // most min(its weight, g's excess), at best per half a move.
      const double load_g = L.gpu_load[g], exc_g = exc(load_g);
      const int ea = L.expert[s];
      const double wa = L.slot_w[s];
      if (2.0 * std::min(wa, exc_g) <= best) continue;
      for (int o = 0; o < G; ++o) {
        // A GPU above T takes all of d as excess while g sheds at most d: no swap with it helps.
        if (o == g || L.gpu_load[o] >= target || (!L.allow_dup && L.on(ea, o) != 0)) continue;
        const double load_o = L.gpu_load[o], exc_o = exc(load_o);
        // Below T, o absorbs up to T - load_o: the excess falls by at most min(that, wa, g's excess).
        if (2.0 * std::min(target - load_o, std::min(wa, exc_g)) <= best) continue;
        for (int t = o * per_gpu; t < (o + 1) * per_gpu; ++t) {
          const double d = wa - L.slot_w[t];
          if (d <= eps) continue;
          const double change = exc(load_g - d) + exc(load_o + d) - exc_g - exc_o;
          if (-change <= eps || -2.0 * change <= best) continue;
          const int eb = L.expert[t];
          if (eb == ea || (!L.allow_dup && L.on(eb, g) != 0)) continue;
          const double score = -change / divisor(slot_cost(s, eb) + slot_cost(t, ea));
          if (score > best) {
            best = score;
            kind = 2;
            first = s;
            second = t;
          }
        }
      }
    }
    if (kind == 0) break;
    if (kind == 1) {
      L.reassign(first, second);
      counts_changed = true;
    } else {
      L.swap_slots(first, second);
    }
    changed = slots_changed(L.expert, origin);
  }
  return changed;
}

}  // namespace fulcrum::eplb::fulcrum_detail
