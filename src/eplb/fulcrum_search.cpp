#include "eplb/fulcrum_search.hpp"

#include <algorithm>
#include <limits>

namespace fulcrum::eplb::fulcrum_detail {

double MoveFinder::raised_max(int e, double delta, int skip1, int skip2) const {
  const Layout& L = layout_;
  double result = -std::numeric_limits<double>::infinity();
  const uint16_t* row = L.hosted.data() + static_cast<size_t>(e) * L.num_gpus;
  for (int k = 0; k < L.num_gpus; ++k) {
    if (row[k] == 0 || k == skip1 || k == skip2) continue;
    result = std::max(result, L.gpu_load[k] + row[k] * delta);
  }
  return result;
}

Move MoveFinder::best_swap(int h, Move best) const {
  const Layout& L = layout_;
  const int per_gpu = L.slots_per_gpu;
  const double load_h = L.gpu_load[h];
  const double eps = 1e-12 * load_h;
  const double min_div = origin_ == nullptr ? 1.0 : 0.5;
  for (int o = g0_; o < g1_; ++o) {
    const double gap = load_h - L.gpu_load[o];
    if (o == h || gap * 0.5 / min_div <= best.score || gap <= eps) continue;
    for (int sa = h * per_gpu; sa < (h + 1) * per_gpu; ++sa) {
      const double wa = L.slot_w[sa];
      const int ea = L.expert[sa];
      for (int sb = o * per_gpu; sb < (o + 1) * per_gpu; ++sb) {
        const double d = wa - L.slot_w[sb];
        if (d <= eps || d >= gap - eps) continue;
        const double gain = std::min(d, gap - d);
        if (gain / min_div <= best.score) continue;
        const int eb = L.expert[sb];
        if (ea == eb) continue;
        if (!L.allow_dup && (L.on(ea, o) != 0 || L.on(eb, h) != 0)) continue;
        const double score = gain / (origin_ == nullptr ? 1.0 : divisor(slot_cost(sa, eb) + slot_cost(sb, ea)));
        if (score > best.score) best = {Move::kSwap, sa, sb, score};
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
  // (1) A slot of h, holding b (count >= 2), gets expert a: h sheds b's replica and takes a's lighter one.
  for (int s = h * per_gpu; s < (h + 1) * per_gpu; ++s) {
    const int b = L.expert[s];
    const int cb = L.count[b];
    if (cb < 2) continue;
    const double delta_b = L.load[b] / (cb - 1) - L.slot_w[s];
    const double others = raised_max(b, delta_b, h, -1);
    const double base = load_h - L.slot_w[s] + (L.on(b, h) - 1) * delta_b;
    if ((load_h - std::max(base, others)) / min_div <= best.score) continue;
    for (int a = 0; a < L.num_experts; ++a) {
      if (a == b || L.count[a] >= L.cap || (!L.allow_dup && L.on(a, h) != 0)) continue;
      const double gain = load_h - std::max(base + L.load[a] / (L.count[a] + 1), others);
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
    const double wa_new = L.load[a] / (ca + 1);
    const double base_h = load_h - L.on(a, h) * (L.slot_w[sa] - wa_new);
    if ((load_h - base_h) / min_div <= best.score) continue;
    for (int t = 0; t < L.num_slots; ++t) {
      const int o = L.gpu_of(t);
      const int b = L.expert[t];
      if (o == h || b == a || L.count[b] < 2 || (!L.allow_dup && L.on(a, o) != 0)) continue;
      const double delta_b = L.load[b] / (L.count[b] - 1) - L.slot_w[t];
      const double new_o = L.gpu_load[o] - L.slot_w[t] + (L.on(b, o) - 1) * delta_b + wa_new + L.on(a, o) * (wa_new - L.slot_w[sa]);
      const double new_h = base_h + L.on(b, h) * delta_b;
      double gain = load_h - std::max(new_o, new_h);
      if (gain <= eps) continue;
      const double div = origin_ == nullptr ? 1.0 : divisor(slot_cost(t, a));
      if (gain / div <= best.score) continue;
      gain = std::min(gain, load_h - raised_max(b, delta_b, h, o));
      if (gain <= eps || gain / div <= best.score) continue;
      best = {Move::kReassign, t, a, gain / div};
    }
  }
  return best;
}

}  // namespace fulcrum::eplb::fulcrum_detail
