// Balanced largest-differencing packing (Karmarkar-Karp style, written for the fulcrum planner).
// Items sorted heaviest first are cut into rows of one item per GPU; each row is a partial solution
// (GPU i holds item i of the row). The two rows whose GPU sums spread most are merged by pairing the
// heaviest GPU of one with the lightest of the other, and so on, until one row remains: every GPU then
// holds exactly one item of each row, i.e. slots_per_gpu items. Pairings that would put two replicas of
// an expert on one GPU are skipped in favour of the next lightest free partner when one exists.
#include <algorithm>
#include <cstdint>

#include "eplb/fulcrum_pack.hpp"

namespace fulcrum::eplb::fulcrum_detail {
namespace {

struct Bin {
  double sum;
  int head, tail;     // item chain through `next`
  uint64_t mask[2];   // bit (expert % 128) of every item: a quick filter before the exact check
};

}  // namespace

void differencing_pack(Layout& layout, std::span<const int> items, std::span<const int> counts, int g0, int g1,
                       uint32_t seed, std::span<const std::pair<double, int>> weighted) {
  const int per_gpu = layout.slots_per_gpu;
  const int gpus = g1 - g0;
  const int num_items = gpus * per_gpu;
  thread_local std::vector<int> order, next, heap;
  thread_local std::vector<std::pair<double, int>> own;
  thread_local std::vector<Bin> bins, merged;
  thread_local std::vector<char> taken;
  thread_local std::vector<std::pair<double, int>> rank;
  std::span<const std::pair<double, int>> sorted = weighted;
  if (seed != 0 || sorted.size() != items.size()) {
    own.clear();
    // A nonzero seed perturbs the weights the merges see by up to +-2% (a deterministic LCG), to get
    // a different packing; the layout always gets the true weights.
    uint32_t state = seed;
    for (int e : items) {
      double w = layout.load[e] / counts[e];
      if (seed != 0) {
        state = state * 1664525u + 1013904223u;
        w *= 1.0 + 0.04 * (static_cast<double>(state >> 8) / 16777216.0 - 0.5);
      }
      own.emplace_back(w, e);
    }
    // Heaviest first; replicas of one expert stay together (ties by expert id).
    auto heavier = [](const auto& x, const auto& y) {
      return x.first > y.first || (x.first == y.first && x.second < y.second);
    };
    if (!std::is_sorted(own.begin(), own.end(), heavier)) std::sort(own.begin(), own.end(), heavier);
    sorted = own;
  }
  order.resize(num_items);
  next.assign(num_items, -1);
  bins.resize(num_items);  // row r occupies bins [r * gpus, (r + 1) * gpus), kept sorted heaviest first
  for (int i = 0; i < num_items; ++i) {
    order[i] = sorted[i].second;
    const int e = sorted[i].second;
    bins[i] = {sorted[i].first, i, i, {0, 0}};
    bins[i].mask[(e >> 6) & 1] = uint64_t{1} << (e & 63);
  }
  auto spread = [&](int r) { return bins[r * gpus].sum - bins[r * gpus + gpus - 1].sum; };
  auto heap_less = [&](int a, int b) { return spread(a) < spread(b) || (spread(a) == spread(b) && a > b); };
  auto conflict = [&](const Bin& x, const Bin& y) {
    if (layout.allow_dup || ((x.mask[0] & y.mask[0]) | (x.mask[1] & y.mask[1])) == 0) return false;
    for (int i = x.head; i >= 0; i = next[i]) {
      for (int j = y.head; j >= 0; j = next[j]) {
        if (order[i] == order[j]) return true;
      }
    }
    return false;
  };
  heap.clear();
  for (int r = 0; r < per_gpu; ++r) heap.push_back(r);
  std::make_heap(heap.begin(), heap.end(), heap_less);
  merged.resize(gpus);
  rank.resize(gpus);
  taken.resize(gpus);
  while (heap.size() > 1) {
    std::pop_heap(heap.begin(), heap.end(), heap_less);
    const int ra = heap.back();
    heap.pop_back();
    std::pop_heap(heap.begin(), heap.end(), heap_less);
    const int rb = heap.back();
    heap.pop_back();
    Bin* a = &bins[ra * gpus];
    Bin* b = &bins[rb * gpus];
    std::fill(taken.begin(), taken.end(), 0);
    for (int i = 0; i < gpus; ++i) {  // a heaviest first, b lightest first
      int pick = -1;
      for (int j = gpus - 1 - i; j >= 0 && pick < 0; --j) {
        if (!taken[j] && !conflict(a[i], b[j])) pick = j;
      }
      if (pick < 0) {
        for (int j = gpus - 1; j >= 0 && pick < 0; --j) {
          if (!taken[j] && !conflict(a[i], b[j])) pick = j;
        }
      }
      if (pick < 0) {
        for (int j = gpus - 1; j >= 0 && pick < 0; --j) {
          if (!taken[j]) pick = j;
        }
      }
      taken[pick] = 1;
      next[a[i].tail] = b[pick].head;
      merged[i] = {a[i].sum + b[pick].sum, a[i].head, b[pick].tail,
                   {a[i].mask[0] | b[pick].mask[0], a[i].mask[1] | b[pick].mask[1]}};
    }
    // Heaviest first: a stable insertion sort of (sum, position) pairs (fewer mispredicts than std::sort,
    // half the bytes of a bin to move), then the bins gathered into a.
    for (int i = 0; i < gpus; ++i) {
      const std::pair<double, int> x(merged[i].sum, i);
      int j = i;
      for (; j > 0 && rank[j - 1].first < x.first; --j) rank[j] = rank[j - 1];
      rank[j] = x;
    }
    for (int i = 0; i < gpus; ++i) a[i] = merged[rank[i].second];
    heap.push_back(ra);
    std::push_heap(heap.begin(), heap.end(), heap_less);
  }
  const Bin* result = &bins[heap.front() * gpus];
  for (int i = 0; i < gpus; ++i) {
    const int g = g0 + i;
    layout.gpu_load[g] = 0.0;
    int slot = g * per_gpu;
    for (int item = result[i].head; item >= 0; item = next[item]) {
      layout.expert[slot] = order[item];
      layout.slot_w[slot] = seed == 0 ? sorted[item].first : layout.load[order[item]] / counts[order[item]];
      layout.gpu_load[g] += layout.slot_w[slot];
      ++slot;
    }
  }
}

}  // namespace fulcrum::eplb::fulcrum_detail
