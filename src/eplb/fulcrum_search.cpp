#include "eplb/fulcrum_search.hpp"

#include <algorithm>
#include <limits>
#include <vector>

namespace fulcrum::eplb::fulcrum_detail {
namespace {

// Index of the slots of the searched range by replica weight, ascending: weight[i] is the weight of
// slot[i]; pos[s] is where slot s sits. A swap exchanges two slots' weights, so it only exchanges
// their entries; reassigns rebuild it.
struct WeightIndex {
  std::vector<double> weight;
  std::vector<int> slot, pos;
  std::vector<int> gpu;  // GPU of each slot (no division in the scan)
};
thread_local WeightIndex index_buf;

// Number of elements <= x in the ascending a[0, n) (std::upper_bound's index), without data-dependent
// branches: the searches here land at unpredictable places, so a branchy search mispredicts often.
int count_at_most(const double* a, int n, double x) {
  if (n <= 0) return 0;
  const double* base = a;
  while (n > 1) {
    const int half = n / 2;
    base += half * static_cast<int>(base[half - 1] <= x);  // a multiply: compilers turn `? :` into a branch
    n -= half;
  }
  return static_cast<int>(base - a) + (*base <= x ? 1 : 0);
}

// The GPUs of [g0, g1) other than h, lightest first (lower index on ties), handed out one at a time: a
// pair's gain is at most half their gap, so scans over partners in this order stop early, usually after
// a few partners, and selecting them lazily costs less than sorting them all.
class LightestFirst {
 public:
  LightestFirst(const Layout& L, int g0, int g1, int h) : load_(L.gpu_load.data()) {
    left_.clear();
    for (int o = g0; o < g1; ++o) {
      if (o != h) left_.push_back(o);
    }
  }
  // The next partner, or -1 when none is left.
  int next() {
    const int n = static_cast<int>(left_.size());
    if (n == 0) return -1;
    int k = 0;
    for (int i = 1; i < n; ++i) {
      const int x = left_[i], y = left_[k];
      if (load_[x] < load_[y] || (load_[x] == load_[y] && x < y)) k = i;
    }
    const int o = left_[k];
    left_[k] = left_[n - 1];
    left_.pop_back();
    return o;
  }

 private:
  const double* load_;
  static thread_local std::vector<int> left_;
};
thread_local std::vector<int> LightestFirst::left_;

}  // namespace

void MoveFinder::build_index(std::span<const int> heaviest_first) {
  if (origin_ != nullptr) return;
  const Layout& L = layout_;
  const int per_gpu = L.slots_per_gpu;
  WeightIndex& ix = index_buf;
  const int s0 = g0_ * per_gpu, s1 = g1_ * per_gpu;
  // Every replica of an expert weighs the same: sort the experts (fewer than the slots), then list
  // each expert's slots in place (slots chained per expert, highest first, so the walk is ascending).
  thread_local std::vector<std::pair<double, int>> experts;
  thread_local std::vector<int> head, next;
  head.assign(L.num_experts, -1);
  next.resize(L.num_slots);
  for (int s = s1 - 1; s >= s0; --s) {
    next[s] = head[L.expert[s]];
    head[L.expert[s]] = s;
  }
  experts.clear();
  if (static_cast<int>(heaviest_first.size()) == L.num_experts) {
    for (auto it = heaviest_first.rbegin(); it != heaviest_first.rend(); ++it) {
      if (head[*it] >= 0) experts.emplace_back(0.0, *it);
    }
  } else {
    for (int e = 0; e < L.num_experts; ++e) {
      if (head[e] >= 0) experts.emplace_back(L.replica_w(e), e);
    }
    std::sort(experts.begin(), experts.end());
  }
  ix.slot.resize(s1 - s0);
  ix.weight.resize(s1 - s0);
  ix.pos.resize(L.num_slots);
  ix.gpu.resize(L.num_slots);
  for (int g = 0, s = 0; g < L.num_gpus; ++g) {
    for (int end = s + per_gpu; s < end; ++s) ix.gpu[s] = g;
  }
  int i = 0;
  for (const auto& [w, e] : experts) {
    for (int s = head[e]; s >= 0; s = next[s], ++i) {
      ix.slot[i] = s;
      ix.weight[i] = L.slot_w[s];
      ix.pos[s] = i;
    }
  }
  indexed_ = true;
}

void MoveFinder::swap(int s1, int s2) {
  layout_.swap_slots(s1, s2);
  if (!indexed_) return;
  WeightIndex& ix = index_buf;
  std::swap(ix.pos[s1], ix.pos[s2]);
  ix.slot[ix.pos[s1]] = s1;
  ix.slot[ix.pos[s2]] = s2;
}

// Same moves and gains as the partner scan below (unless `enough` cuts it short), found through the weight
// index: for a replica a of h (weight wa, rest of h R = L_h - wa) and b on GPU o,
// gain = min(wa - wb, R - (L_o - wb)), so only wb in (L_min - R + best, wa - best) can beat `best`, where
// L_min is the lightest other GPU's load.
Move MoveFinder::best_swap_indexed(int h, double min_other, double enough) const {
  const Layout& L = layout_;
  const WeightIndex& ix = index_buf;
  const int per_gpu = L.slots_per_gpu;
  const double load_h = L.gpu_load[h];
  const double eps = 1e-12 * load_h;
  Move best;
  const double* w = ix.weight.data();
  for (int sa = h * per_gpu; sa < (h + 1) * per_gpu; ++sa) {
    const double wa = L.slot_w[sa];
    if (wa <= eps) continue;
    const int ea = L.expert[sa];
    const double rest = load_h - wa;
    const double floor = std::max(best.score, eps);
    const double lo_w = min_other - rest + floor;
    const double hi_w = wa - floor;
    // The candidates are lighter than wa: walk down the index from sa's own entry (no search needed).
    // Of equal gains the lowest index wins (an upward scan's first), hence >= below.
    int i = ix.pos[sa];
    while (i >= 0 && !(w[i] < hi_w)) --i;
    int found = -1;
    double found_gain = floor;
    for (; i >= 0 && w[i] > lo_w; --i) {
      const int sb = ix.slot[i];
      const int o = ix.gpu[sb];
      if (o == h) continue;
      const double d = wa - w[i];
      const double gain = std::min(d, rest - L.gpu_load[o] + w[i]);
      if (gain < found_gain || (gain == found_gain && found < 0)) continue;
      const int eb = L.expert[sb];
      if (ea == eb || (!L.allow_dup && (L.on(ea, o) != 0 || L.on(eb, h) != 0))) continue;
      found = i;
      found_gain = gain;
      if (gain >= enough) break;
    }
    if (found >= 0) best = {Move::kSwap, sa, ix.slot[found], found_gain};
    if (best.score >= enough) return best;
  }
  return best;
}

Move MoveFinder::best_swap(int h, Move best) const {
  const Layout& L = layout_;
  if (indexed_ && !best.valid()) {
    double min_other = std::numeric_limits<double>::infinity();
    for (int o = g0_; o < g1_; ++o) {
      if (o != h) min_other = std::min(min_other, L.gpu_load[o]);
    }
    return best_swap_indexed(h, min_other);
  }
  const int per_gpu = L.slots_per_gpu;
  const double load_h = L.gpu_load[h];
  const double eps = 1e-12 * load_h;
  const double min_div = origin_ == nullptr ? 1.0 : 0.5;
  LightestFirst partners(L, g0_, g1_, h);
  for (int o = partners.next(); o >= 0; o = partners.next()) {
    const double gap = load_h - L.gpu_load[o];
    if (gap * 0.5 / min_div <= best.score || gap <= eps) break;
    const double* wb = L.slot_w.data() + o * per_gpu;
    const int32_t* eb = L.expert.data() + o * per_gpu;
    for (int sa = h * per_gpu; sa < (h + 1) * per_gpu; ++sa) {
      const double wa = L.slot_w[sa];
      const int ea = L.expert[sa];
      if (wa <= eps || (!L.allow_dup && L.on(ea, o) != 0)) continue;
      for (int j = 0; j < per_gpu; ++j) {
        const double d = wa - wb[j];
        const double gain = std::min(d, gap - d);
        if (gain <= eps || gain / min_div <= best.score) continue;
        if (ea == eb[j] || (!L.allow_dup && L.on(eb[j], h) != 0)) continue;
        const int sb = o * per_gpu + j;
        const double score = gain / (origin_ == nullptr ? 1.0 : divisor(slot_cost(sa, eb[j]) + slot_cost(sb, ea)));
        if (score > best.score) best = {Move::kSwap, sa, sb, score};
      }
    }
  }
  return best;
}

Move MoveFinder::best_pair_swap(int h, double enough) const {
  const Layout& L = layout_;
  const int per_gpu = L.slots_per_gpu;
  Move best;
  if (per_gpu < 2) return best;
  const double load_h = L.gpu_load[h];
  const double eps = 1e-12 * load_h;
  // h's pairs by weight sum, ascending: for a pair of o with sum s, only pairs of h with sum in
  // (s + best, s + gap - best) can beat the best gain, since gain = min(d, gap - d) with d their difference.
  thread_local std::vector<std::pair<double, int>> pairs_h;  // (sum, i * per_gpu + j)
  thread_local std::vector<double> sums_h;
  pairs_h.clear();
  for (int i = 0; i < per_gpu; ++i) {
    for (int j = i + 1; j < per_gpu; ++j) {
      pairs_h.emplace_back(L.slot_w[h * per_gpu + i] + L.slot_w[h * per_gpu + j], i * per_gpu + j);
    }
  }
  std::sort(pairs_h.begin(), pairs_h.end(), [](const auto& x, const auto& y) {
    return x.first < y.first || (x.first == y.first && x.second < y.second);
  });
  sums_h.resize(pairs_h.size());
  for (size_t k = 0; k < pairs_h.size(); ++k) sums_h[k] = pairs_h[k].first;
  const double* sums = sums_h.data();
  const int num_pairs = static_cast<int>(sums_h.size());
  LightestFirst partners(L, g0_, g1_, h);
  for (int o = partners.next(); o >= 0; o = partners.next()) {
    const double gap = load_h - L.gpu_load[o];
    if (gap * 0.5 <= best.score || gap <= eps) break;
    for (int i = 0; i < per_gpu; ++i) {
      const int si = o * per_gpu + i;
      for (int j = i + 1; j < per_gpu; ++j) {
        const int sj = o * per_gpu + j;
        const double sum_o = L.slot_w[si] + L.slot_w[sj];
        double floor = std::max(best.score, eps);
        if (gap - floor <= floor) break;
        int k = count_at_most(sums, num_pairs, sum_o + floor);
        for (; k < num_pairs && sums[k] < sum_o + gap - floor; ++k) {
          const double d = sums[k] - sum_o;
          const double gain = std::min(d, gap - d);
          if (gain <= floor) continue;
          const int code = pairs_h[k].second;
          const int sa = h * per_gpu + code / per_gpu, sc = h * per_gpu + code % per_gpu;
          const int ea = L.expert[sa], ec = L.expert[sc], eb = L.expert[si], ed = L.expert[sj];
          if (!L.allow_dup && (L.on(ea, o) != 0 || L.on(ec, o) != 0 || L.on(eb, h) != 0 || L.on(ed, h) != 0)) continue;
          best = {Move::kSwapPairs, sa, si, gain, sc, sj};
          if (gain >= enough) return best;
          floor = gain;
        }
      }
    }
  }
  return best;
}

Move MoveFinder::best_reassign(int h, Move best) const {
  const Layout& L = layout_;
  const int per_gpu = L.slots_per_gpu;
  const double load_h = L.gpu_load[h];
  const double eps = 1e-12 * load_h;
  const double min_div = origin_ == nullptr ? 1.0 : 0.5;
  // Per expert b with a spare replica: the two largest loads among GPUs other than h that hold b, once
  // b loses a replica (so each of its replicas grows by delta_b).
  constexpr double kNone = -std::numeric_limits<double>::infinity();
  thread_local std::vector<double> top1, top2, grown_w, delta;
  thread_local std::vector<int> top1_gpu;
  grown_w.resize(L.num_experts);  // load per replica with one more replica
  delta.resize(L.num_experts);    // growth of each replica with one fewer
  for (int e = 0; e < L.num_experts; ++e) {
    grown_w[e] = L.load[e] / (L.count[e] + 1);
    delta[e] = L.count[e] < 2 ? 0.0 : L.load[e] / (L.count[e] - 1) - L.replica_w(e);
  }
  top1.assign(L.num_experts, kNone);
  top2.assign(L.num_experts, kNone);
  top1_gpu.assign(L.num_experts, -1);
  for (int b = 0; b < L.num_experts; ++b) {
    if (L.count[b] < 2) continue;
    const double delta_b = delta[b];
    const uint16_t* row = L.hosted.data() + static_cast<size_t>(b) * L.num_gpus;
    for (int k = 0; k < L.num_gpus; ++k) {
      if (row[k] == 0 || k == h) continue;
      const double v = L.gpu_load[k] + row[k] * delta_b;
      if (v > top1[b]) {
        top2[b] = top1[b];
        top1[b] = v;
        top1_gpu[b] = k;
      } else if (v > top2[b]) {
        top2[b] = v;
      }
    }
  }
  // (1) A slot of h, holding b (count >= 2), gets expert a: h sheds b's replica and takes a's lighter one.
  for (int s = h * per_gpu; s < (h + 1) * per_gpu; ++s) {
    const int b = L.expert[s];
    const int cb = L.count[b];
    if (cb < 2) continue;
    const double delta_b = L.load[b] / (cb - 1) - L.slot_w[s];
    const double others = top1[b];
    const double base = load_h - L.slot_w[s] + (L.on(b, h) - 1) * delta_b;
    if ((load_h - std::max(base, others)) / min_div <= best.score) continue;
    for (int a = 0; a < L.num_experts; ++a) {
      if (a == b || L.count[a] >= L.cap || (!L.allow_dup && L.on(a, h) != 0)) continue;
      const double gain = load_h - std::max(base + grown_w[a], others);
      if (gain <= eps) continue;
      const double score = gain / (origin_ == nullptr ? 1.0 : divisor(slot_cost(s, a)));
      if (score > best.score) best = {Move::kReassign, s, a, score};
    }
  }
  // (2) An expert a of h gets one more replica, in a slot elsewhere that held b (count >= 2).
  for (int sa = h * per_gpu; sa < (h + 1) * per_gpu; ++sa) {
    const int a = L.expert[sa];
    const int ca = L.count[a];
    if (ca >= L.cap) continue;
    const double wa_new = grown_w[a];
    const double base_h = load_h - L.on(a, h) * (L.slot_w[sa] - wa_new);
    if ((load_h - base_h) / min_div <= best.score) continue;
    for (int t = 0; t < L.num_slots; ++t) {
      const int o = L.gpu_of(t);
      const int b = L.expert[t];
      if (o == h || b == a || L.count[b] < 2 || (!L.allow_dup && L.on(a, o) != 0)) continue;
      const double delta_b = delta[b];
      const double new_o = L.gpu_load[o] - L.slot_w[t] + (L.on(b, o) - 1) * delta_b + wa_new + L.on(a, o) * (wa_new - L.slot_w[sa]);
      const double new_h = base_h + L.on(b, h) * delta_b;
      double gain = load_h - std::max(new_o, new_h);
      if (gain <= eps) continue;
      const double div = origin_ == nullptr ? 1.0 : divisor(slot_cost(t, a));
      if (gain / div <= best.score) continue;
      gain = std::min(gain, load_h - (top1_gpu[b] != o ? top1[b] : top2[b]));
      if (gain <= eps || gain / div <= best.score) continue;
      best = {Move::kReassign, t, a, gain / div};
    }
  }
  return best;
}

}  // namespace fulcrum::eplb::fulcrum_detail
