#include "eplb/fulcrum_layout.hpp"

#include <algorithm>
#include <limits>

namespace fulcrum::eplb::fulcrum_detail {

void Layout::reset(std::span<const double> expert_load, int slots, int gpus) {
  load = expert_load;
  num_experts = static_cast<int>(expert_load.size());
  num_slots = slots;
  num_gpus = gpus;
  slots_per_gpu = slots / gpus;
  allow_dup = static_cast<int64_t>(slots) > static_cast<int64_t>(num_experts) * gpus;
  cap = allow_dup ? std::numeric_limits<int>::max() : gpus;
  expert.resize(slots);
  count.resize(num_experts);
  slot_w.resize(slots);
  gpu_load.resize(gpus);
  hosted.resize(static_cast<size_t>(num_experts) * gpus);
}

void Layout::rebuild() {
  std::fill(count.begin(), count.end(), 0);
  std::fill(hosted.begin(), hosted.end(), uint16_t{0});
  for (int g = 0, s = 0; g < num_gpus; ++g) {
    for (int end = s + slots_per_gpu; s < end; ++s) {
      ++count[expert[s]];
      ++hosted[static_cast<size_t>(expert[s]) * num_gpus + g];
    }
  }
  for (int g = 0, s = 0; g < num_gpus; ++g) {
    double sum = 0.0;
    for (int end = s + slots_per_gpu; s < end; ++s) {
      slot_w[s] = replica_w(expert[s]);
      sum += slot_w[s];
    }
    gpu_load[g] = sum;
  }
}

int Layout::heaviest(int g0, int g1) const {
  int best = g0;
  for (int g = g0 + 1; g < g1; ++g) {
    if (gpu_load[g] > gpu_load[best]) best = g;
  }
  return best;
}

void Layout::swap_slots(int s1, int s2) {
  const int g1 = gpu_of(s1), g2 = gpu_of(s2);
  const int e1 = expert[s1], e2 = expert[s2];
  const double w1 = slot_w[s1], w2 = slot_w[s2];
  gpu_load[g1] += w2 - w1;
  gpu_load[g2] += w1 - w2;
  --hosted[static_cast<size_t>(e1) * num_gpus + g1];
  ++hosted[static_cast<size_t>(e1) * num_gpus + g2];
  --hosted[static_cast<size_t>(e2) * num_gpus + g2];
  ++hosted[static_cast<size_t>(e2) * num_gpus + g1];
  std::swap(expert[s1], expert[s2]);
  std::swap(slot_w[s1], slot_w[s2]);
}

void Layout::refresh_weight(int e) {
  const double w = replica_w(e);
  for (int s = 0; s < num_slots; ++s) {
    if (expert[s] == e && slot_w[s] != w) {
      gpu_load[gpu_of(s)] += w - slot_w[s];
      slot_w[s] = w;
    }
  }
}

void Layout::reassign(int s, int a) {
  const int g = gpu_of(s);
  const int b = expert[s];
  gpu_load[g] -= slot_w[s];
  --hosted[static_cast<size_t>(b) * num_gpus + g];
  --count[b];
  expert[s] = a;
  ++count[a];
  ++hosted[static_cast<size_t>(a) * num_gpus + g];
  slot_w[s] = replica_w(a);
  gpu_load[g] += slot_w[s];
  refresh_weight(a);
  refresh_weight(b);
}

}  // namespace fulcrum::eplb::fulcrum_detail
