// Balanced dispatch: per batch, split each expert's tokens over its replicas to minimize the max GPU load.
// Only the total per expert matters for GPU loads (any source may use any replica), so the split is a
// transportation problem: experts on one GPU are fixed load there; experts on >= 2 GPUs ("flexible") flow
// into their GPUs, each GPU taking at most L minus its fixed load. Starting from a lower bound on L, a
// Dinic max-flow either routes everything (L is optimal) or its min cut proves a higher bound; L rises to
// it and the same flow continues. Exact for integer tokens, usually one or two rounds.
#include <algorithm>
#include <limits>
#include <numeric>

#include "eplb/dispatch.hpp"

namespace fulcrum::eplb {

BalancedSplitter::BalancedSplitter(std::span<const int32_t> layer_map, int num_logical_experts,
                                   const Topology& topo)
    : num_gpus_(topo.num_gpus), num_experts_(num_logical_experts),
      replicas_(layer_map, num_logical_experts, topo) {
  // Distinct GPUs per expert (slots ascending, so GPUs ascending) and the slots of each (expert, GPU) pair.
  expert_gpu_offsets_.push_back(0);
  pair_slot_offsets_.push_back(0);
  for (int e = 0; e < num_experts_; ++e) {
    for (int32_t slot : replicas_.of(e)) {
      const int gpu = topo.gpu_of_slot(slot);
      if (static_cast<int>(expert_gpus_.size()) == expert_gpu_offsets_.back() || expert_gpus_.back() != gpu) {
        expert_gpus_.push_back(gpu);
        pair_slot_offsets_.push_back(pair_slot_offsets_.back());
      }
      pair_slots_.push_back(slot);
      ++pair_slot_offsets_.back();
    }
    expert_gpu_offsets_.push_back(static_cast<int32_t>(expert_gpus_.size()));
    if (expert_gpu_offsets_[e + 1] - expert_gpu_offsets_[e] >= 2) flexible_experts_.push_back(e);
  }
  // Flow network edges, in pairs (forward, reverse).
  const int num_flexible = static_cast<int>(flexible_experts_.size());
  const int num_nodes = num_flexible + num_gpus_ + 2;
  const int sink = num_nodes - 1;
  std::vector<std::pair<int, int>> arcs;  // forward arcs (from, to)
  for (int i = 0; i < num_flexible; ++i) arcs.emplace_back(0, 1 + i);
  pair_edge_.assign(expert_gpus_.size(), -1);
  for (int i = 0; i < num_flexible; ++i) {
    const int e = flexible_experts_[i];
    for (int p = expert_gpu_offsets_[e]; p < expert_gpu_offsets_[e + 1]; ++p) {
      pair_edge_[p] = 2 * static_cast<int>(arcs.size());
      arcs.emplace_back(1 + i, 1 + num_flexible + expert_gpus_[p]);
    }
  }
  for (int g = 0; g < num_gpus_; ++g) arcs.emplace_back(1 + num_flexible + g, sink);
  edge_to_.resize(2 * arcs.size());
  node_edge_offsets_.assign(num_nodes + 1, 0);
  for (size_t k = 0; k < arcs.size(); ++k) {
    edge_to_[2 * k] = arcs[k].second;
    edge_to_[2 * k + 1] = arcs[k].first;
    ++node_edge_offsets_[arcs[k].first + 1];
    ++node_edge_offsets_[arcs[k].second + 1];
  }
  std::partial_sum(node_edge_offsets_.begin(), node_edge_offsets_.end(), node_edge_offsets_.begin());
  node_edges_.resize(2 * arcs.size());
  std::vector<int32_t> fill(node_edge_offsets_.begin(), node_edge_offsets_.end() - 1);
  for (size_t k = 0; k < arcs.size(); ++k) {
    node_edges_[fill[arcs[k].first]++] = static_cast<int32_t>(2 * k);
    node_edges_[fill[arcs[k].second]++] = static_cast<int32_t>(2 * k + 1);
  }
  edge_cap_.assign(edge_to_.size(), 0);
  edge_residual_.assign(edge_to_.size(), 0);
  for (int g = 0; g < num_gpus_; ++g) gpu_node_.push_back(topo.node_of_gpu(g));
  level_.resize(num_nodes);
  next_edge_.resize(num_nodes);
  bfs_queue_.resize(num_nodes);
}

int64_t BalancedSplitter::augment(int node, int64_t limit) {
  const int sink = static_cast<int>(level_.size()) - 1;
  if (node == sink) return limit;
  for (int32_t& i = next_edge_[node]; i < node_edge_offsets_[node + 1]; ++i) {
    const int edge = node_edges_[i];
    const int to = edge_to_[edge];
    if (edge_residual_[edge] <= 0 || level_[to] != level_[node] + 1) continue;
    const int64_t pushed = augment(to, std::min(limit, edge_residual_[edge]));
    if (pushed > 0) {
      edge_residual_[edge] -= pushed;
      edge_residual_[edge ^ 1] += pushed;
      return pushed;
    }
  }
  return 0;
}

int64_t BalancedSplitter::min_max_load(int64_t lower) {
  const int num_flexible = static_cast<int>(flexible_experts_.size());
  const int num_edges_half = static_cast<int>(edge_to_.size()) / 2;
  const int gpu_edge_half = num_edges_half - num_gpus_;  // first GPU -> sink edge pair
  int64_t needed = 0;
  std::fill(edge_cap_.begin(), edge_cap_.end(), 0);
  for (int i = 0; i < num_flexible; ++i) {
    const int64_t t = expert_tokens_[flexible_experts_[i]];
    edge_cap_[2 * i] = t;
    needed += t;
  }
  for (int k = num_flexible; k < gpu_edge_half; ++k) edge_cap_[2 * k] = std::numeric_limits<int64_t>::max() / 4;
  for (int g = 0; g < num_gpus_; ++g) edge_cap_[2 * (gpu_edge_half + g)] = lower - fixed_load_[g];
  std::copy(edge_cap_.begin(), edge_cap_.end(), edge_residual_.begin());
  const int num_nodes = static_cast<int>(level_.size());
  const int first_gpu_node = 1 + num_flexible;
  int64_t max_load = lower, flow = 0;
  while (true) {
    // Dinic phase: BFS levels from the source; augment along them until blocked.
    std::fill(level_.begin(), level_.end(), -1);
    int head = 0, tail = 0;
    bfs_queue_[tail++] = 0;
    level_[0] = 0;
    while (head < tail) {
      const int v = bfs_queue_[head++];
      for (int i = node_edge_offsets_[v]; i < node_edge_offsets_[v + 1]; ++i) {
        const int edge = node_edges_[i];
        if (edge_residual_[edge] > 0 && level_[edge_to_[edge]] < 0) {
          level_[edge_to_[edge]] = level_[v] + 1;
          bfs_queue_[tail++] = edge_to_[edge];
        }
      }
    }
    if (level_[num_nodes - 1] >= 0) {
      std::copy(node_edge_offsets_.begin(), node_edge_offsets_.end() - 1, next_edge_.begin());
      while (const int64_t pushed = augment(0, needed - flow)) flow += pushed;
      continue;
    }
    if (flow == needed) return max_load;
    // Max flow at this level falls short. The min cut's GPUs S (reachable from the source) must absorb
    // the deficit: any feasible level is >= max_load + ceil(deficit / |S|). Raising every GPU's room by
    // that keeps the current flow valid, so the search only ever continues, never restarts.
    int num_cut_gpus = 0;
    for (int g = 0; g < num_gpus_; ++g) num_cut_gpus += level_[first_gpu_node + g] >= 0 ? 1 : 0;
    const int64_t raise = (needed - flow + num_cut_gpus - 1) / num_cut_gpus;
    max_load += raise;
    for (int g = 0; g < num_gpus_; ++g) {
      edge_cap_[2 * (gpu_edge_half + g)] += raise;
      edge_residual_[2 * (gpu_edge_half + g)] += raise;
    }
  }
}

void BalancedSplitter::split(std::span<const int64_t> tokens, BalancedDispatch& out) {
  FULCRUM_CHECK(tokens.size() == static_cast<size_t>(num_gpus_) * num_experts_,
                "balanced split got {} token counts, expected {} GPUs x {} experts", tokens.size(), num_gpus_,
                num_experts_);
  // Tokens per expert, fixed load of single-GPU experts, lower bound on the max load.
  expert_tokens_.assign(num_experts_, 0);
  int64_t min_count = 0;
  for (int g = 0; g < num_gpus_; ++g) {
    const int64_t* row = tokens.data() + static_cast<size_t>(g) * num_experts_;
    for (int e = 0; e < num_experts_; ++e) {
      expert_tokens_[e] += row[e];
      min_count = std::min(min_count, row[e]);
    }
  }
  FULCRUM_CHECK(min_count >= 0, "balanced split got a negative token count ({})", min_count);
  fixed_load_.assign(num_gpus_, 0);
  pair_tokens_.assign(expert_gpus_.size(), 0);
  int64_t total = 0;
  for (int e = 0; e < num_experts_; ++e) {
    total += expert_tokens_[e];
    const int p = expert_gpu_offsets_[e];
    if (expert_gpu_offsets_[e + 1] - p == 1) {
      fixed_load_[expert_gpus_[p]] += expert_tokens_[e];
      pair_tokens_[p] = expert_tokens_[e];
    }
  }
  int64_t lower = (total + num_gpus_ - 1) / num_gpus_;
  for (int64_t f : fixed_load_) lower = std::max(lower, f);

  // Exact min-max split of the flexible experts; the flow on each expert -> GPU edge is that pair's share.
  min_max_load(lower);
  for (int e : flexible_experts_) {
    for (int p = expert_gpu_offsets_[e]; p < expert_gpu_offsets_[e + 1]; ++p) {
      pair_tokens_[p] = edge_cap_[pair_edge_[p]] - edge_residual_[pair_edge_[p]];
    }
  }
  std::vector<int64_t>& load = out.gpu_loads;
  load.assign(num_gpus_, 0);
  for (int e = 0; e < num_experts_; ++e) {
    for (int p = expert_gpu_offsets_[e]; p < expert_gpu_offsets_[e + 1]; ++p) load[expert_gpus_[p]] += pair_tokens_[p];
  }
  out.max_gpu_load = *std::max_element(load.begin(), load.end());

  // Routes: every source's tokens to its local replica first, then same node, then anywhere.
  out.expert_route_offsets.assign(num_experts_ + 1, 0);
  out.routes.clear();
  pair_left_.assign(pair_tokens_.begin(), pair_tokens_.end());
  source_left_.resize(num_gpus_);
  auto emit = [&](int src, int p, int64_t count) {
    const int first_slot = pair_slot_offsets_[p], num_slots = pair_slot_offsets_[p + 1] - first_slot;
    if (num_slots == 1) {
      out.routes.push_back({src, pair_slots_[first_slot], count});
      return;
    }
    for (int s = 0; s < num_slots; ++s) {  // several replicas on one GPU share its tokens evenly
      const int64_t part = count / num_slots + (s < count % num_slots ? 1 : 0);
      if (part > 0) out.routes.push_back({src, pair_slots_[first_slot + s], part});
    }
  };
  for (int e = 0; e < num_experts_; ++e) {
    const int first = expert_gpu_offsets_[e], last = expert_gpu_offsets_[e + 1];
    if (last - first == 1) {  // one GPU: every source goes there
      for (int src = 0; src < num_gpus_; ++src) {
        const int64_t count = tokens[static_cast<size_t>(src) * num_experts_ + e];
        if (count > 0) emit(src, first, count);
      }
      out.expert_route_offsets[e + 1] = static_cast<int32_t>(out.routes.size());
      continue;
    }
    for (int src = 0; src < num_gpus_; ++src) source_left_[src] = tokens[static_cast<size_t>(src) * num_experts_ + e];
    // All sources take their local share before anyone spills onto another GPU's share.
    for (int p = first; p < last; ++p) {
      const int src = expert_gpus_[p];
      const int64_t take = std::min(source_left_[src], pair_left_[p]);
      if (take == 0) continue;
      pair_left_[p] -= take;
      source_left_[src] -= take;
      emit(src, p, take);
    }
    for (int pass = 1; pass < 3; ++pass) {  // 1: same node, 2: anywhere
      for (int src = 0; src < num_gpus_; ++src) {
        int64_t& left = source_left_[src];
        for (int p = first; p < last && left > 0; ++p) {
          if (pair_left_[p] == 0 || (pass == 1 && gpu_node_[expert_gpus_[p]] != gpu_node_[src])) continue;
          const int64_t take = std::min(left, pair_left_[p]);
          pair_left_[p] -= take;
          left -= take;
          emit(src, p, take);
        }
      }
    }
    out.expert_route_offsets[e + 1] = static_cast<int32_t>(out.routes.size());
  }
}

void build_balanced_route_table(const BalancedDispatch& split, int num_gpus, BalancedRouteTable& out) {
  const int num_experts = static_cast<int>(split.expert_route_offsets.size()) - 1;
  out.num_experts = num_experts;
  out.offsets.assign(static_cast<size_t>(num_gpus) * num_experts + 1, 0);
  for (int e = 0; e < num_experts; ++e) {
    for (int r = split.expert_route_offsets[e]; r < split.expert_route_offsets[e + 1]; ++r) {
      const int src = split.routes[static_cast<size_t>(r)].src_gpu_idx;
      FULCRUM_CHECK(src >= 0 && src < num_gpus, "balanced route from GPU {} of {}", src, num_gpus);
      ++out.offsets[static_cast<size_t>(src) * num_experts + e + 1];
    }
  }
  std::partial_sum(out.offsets.begin(), out.offsets.end(), out.offsets.begin());
  out.slots.resize(split.routes.size());
  out.ends.resize(split.routes.size());
  std::vector<int32_t> fill(out.offsets.begin(), out.offsets.end() - 1);
  for (int e = 0; e < num_experts; ++e) {  // routes of one pair keep their order
    for (int r = split.expert_route_offsets[e]; r < split.expert_route_offsets[e + 1]; ++r) {
      const DispatchRoute& route = split.routes[static_cast<size_t>(r)];
      const size_t pair = static_cast<size_t>(route.src_gpu_idx) * num_experts + e;
      const int32_t at = fill[pair]++;
      out.slots[at] = route.slot_idx;
      out.ends[at] = (at > out.offsets[pair] ? out.ends[at - 1] : 0) + route.num_tokens;
    }
  }
}

int32_t BalancedRouteTable::slot(int src_gpu_idx, int expert_idx, int64_t index) const {
  const size_t pair = static_cast<size_t>(src_gpu_idx) * num_experts + expert_idx;
  for (int32_t r = offsets[pair]; r < offsets[pair + 1]; ++r) {
    if (index < ends[r]) return slots[r];
  }
  throw Error(fmt::format("balanced dispatch: no route for token {} of expert {} from EP rank {}", index, expert_idx,
                          src_gpu_idx));
}

}  // namespace fulcrum::eplb
