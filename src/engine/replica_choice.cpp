#include "engine/replica_choice.hpp"

#include <algorithm>

#include "eplb/error.hpp"

namespace fulcrum::engine {

uint64_t dynamic_dispatch_stream(uint64_t seed, uint64_t pass_idx, int moe_layer_idx, int source) {
  eplb::SplitMix64 mix(seed ^ (pass_idx * 0x9e3779b97f4a7c15ULL));
  return mix.next() ^ (uint64_t(moe_layer_idx) << 32) ^ uint64_t(source);
}

ReplicaChooser::ReplicaChooser(eplb::DispatchAlgorithm algorithm, uint64_t seed, int num_sources,
                               int sources_per_ep_rank)
    : algorithm_(algorithm), seed_(seed), num_sources_(num_sources), sources_per_ep_rank_(sources_per_ep_rank) {
  FULCRUM_CHECK(num_sources > 0 && sources_per_ep_rank > 0 && num_sources % sources_per_ep_rank == 0,
                "replica chooser: {} sources in groups of {}", num_sources, sources_per_ep_rank);
}

void ReplicaChooser::set_layer(int moe_layer_idx, std::span<const int32_t> layer_map, int num_logical_experts,
                               const eplb::Topology& topo) {
  FULCRUM_CHECK(topo.num_gpus * sources_per_ep_rank_ == num_sources_, "replica chooser: {} EP ranks x {} != {} sources",
                topo.num_gpus, sources_per_ep_rank_, num_sources_);
  moe_layer_idx_ = moe_layer_idx;
  const bool same = num_logical_experts == num_experts_ && topo.num_physical_experts == topo_.num_physical_experts &&
                    topo.num_gpus == topo_.num_gpus && std::equal(layer_map.begin(), layer_map.end(),
                                                                  layer_map_.begin(), layer_map_.end());
  if (same) return;
  num_experts_ = num_logical_experts;
  topo_ = topo;
  layer_map_.assign(layer_map.begin(), layer_map.end());
  if (algorithm_ == eplb::DispatchAlgorithm::kStatic) {
    static_table_ = eplb::build_static_dispatch(layer_map_, num_experts_, topo_);
  } else if (algorithm_ == eplb::DispatchAlgorithm::kBalanced) {
    splitter_ = std::make_unique<eplb::BalancedSplitter>(layer_map_, num_experts_, topo_);
  } else {
    eplb::ReplicaIndex check(layer_map_, num_experts_, topo_);  // validates the map once per change
  }
}

void ReplicaChooser::begin_pass(uint64_t pass_idx, std::span<const int64_t> counts) {
  pass_idx_ = pass_idx;
  if (!needs_counts()) return;
  FULCRUM_CHECK(counts.size() == static_cast<size_t>(num_sources_) * num_experts_,
                "balanced dispatch needs {} x {} counts, got {}", num_sources_, num_experts_, counts.size());
  counts_.assign(counts.begin(), counts.end());
  std::vector<int64_t> tokens(static_cast<size_t>(topo_.num_gpus) * num_experts_, 0);  // [EP ranks][E]
  for (int source = 0; source < num_sources_; ++source) {
    const int gpu = source / sources_per_ep_rank_;
    for (int e = 0; e < num_experts_; ++e) {
      tokens[static_cast<size_t>(gpu) * num_experts_ + e] += counts[static_cast<size_t>(source) * num_experts_ + e];
    }
  }
  splitter_->split(tokens, split_);
  eplb::build_balanced_route_table(split_, topo_.num_gpus, route_table_);
}

void ReplicaChooser::choose(int source, std::span<const int32_t> experts, std::span<int32_t> slots) {
  FULCRUM_CHECK(source >= 0 && source < num_sources_ && experts.size() == slots.size(),
                "replica chooser: source {} of {}, {} experts for {} slots", source, num_sources_, experts.size(),
                slots.size());
  const int gpu = source / sources_per_ep_rank_;
  switch (algorithm_) {
    case eplb::DispatchAlgorithm::kStatic:
      for (size_t i = 0; i < experts.size(); ++i) slots[i] = static_table_.slot(gpu, experts[i]);
      return;
    case eplb::DispatchAlgorithm::kDynamic: {
      eplb::DynamicDispatcher dynamic(layer_map_, num_experts_, topo_,
                                      dynamic_dispatch_stream(seed_, pass_idx_, moe_layer_idx_, source));
      for (size_t i = 0; i < experts.size(); ++i) slots[i] = dynamic.pick(experts[i]);
      return;
    }
    case eplb::DispatchAlgorithm::kBalanced: {
      // taken[e]: tokens of expert e from this EP rank already assigned (lower sources, then earlier entries).
      std::vector<int64_t> taken(static_cast<size_t>(num_experts_), 0);
      for (int lower = gpu * sources_per_ep_rank_; lower < source; ++lower) {
        for (int e = 0; e < num_experts_; ++e) taken[e] += counts_[static_cast<size_t>(lower) * num_experts_ + e];
      }
      for (size_t i = 0; i < experts.size(); ++i) slots[i] = route_table_.slot(gpu, experts[i], taken[experts[i]]++);
      return;
    }
  }
}

}  // namespace fulcrum::engine
