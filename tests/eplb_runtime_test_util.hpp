#pragma once
// Helpers shared by the EPLB runtime tests: synthetic expert slots whose values encode
// (MoE layer, logical expert, element), and random valid placements.
#include <algorithm>
#include <random>
#include <vector>

#include "eplb/placement.hpp"
#include "model/backend.hpp"
#include "model/qwen3_moe.hpp"

namespace fulcrum::eplb_runtime::test {

constexpr int64_t kHidden = 3, kWidth = 2;  // gate_up [2*2, 3], down [3, 2]

inline float weight_value(int moe_layer_idx, int expert_idx, int64_t element) {
  return static_cast<float>(moe_layer_idx * 100000 + expert_idx * 100 + element);
}

// One rank's model-like storage: per owned MoE layer its slot tensors and map (the view points into them).
struct RankSlots {
  std::vector<std::vector<int32_t>> maps;  // per view
  std::vector<model::ExpertSlotView> views;
};

inline RankSlots make_rank_slots(model::Backend& backend, const eplb::Placement& placement, int rank,
                          const std::vector<int>& owned_layers) {
  RankSlots slots;
  const int slots_per_rank = placement.topology.slots_per_gpu();
  slots.maps.reserve(owned_layers.size());
  for (const int l : owned_layers) {
    const auto row = placement.layer(l).subspan(static_cast<size_t>(rank * slots_per_rank), slots_per_rank);
    slots.maps.emplace_back(row.begin(), row.end());
    model::ExpertSlotView view;
    view.layer_idx = 2 * l + 1;
    view.moe_layer_idx = l;
    view.num_slots = slots_per_rank;
    view.num_logical_experts = placement.num_logical_experts;
    view.gate_up = backend.zeros({slots_per_rank, 2 * kWidth, kHidden});
    view.down = backend.zeros({slots_per_rank, kHidden, kWidth});
    view.physical_to_logical = slots.maps.back();
    for (int s = 0; s < slots_per_rank; ++s) {
      std::vector<float> gate_up(2 * kWidth * kHidden), down(kHidden * kWidth);
      for (size_t i = 0; i < gate_up.size(); ++i) gate_up[i] = weight_value(l, row[s], static_cast<int64_t>(i));
      for (size_t i = 0; i < down.size(); ++i) down[i] = weight_value(l, row[s], 1000 + static_cast<int64_t>(i)) ;
      backend.upload(view.gate_up.index(s), gate_up);
      backend.upload(view.down.index(s), down);
    }
    slots.views.push_back(view);
  }
  return slots;
}

// True when slot `s` of `view` holds exactly expert `expert_idx`'s weights.
inline bool slot_holds(model::Backend& backend, const model::ExpertSlotView& view, int s, int expert_idx) {
  const auto gate_up = backend.download(view.gate_up.index(s));
  const auto down = backend.download(view.down.index(s));
  for (size_t i = 0; i < gate_up.size(); ++i) {
    if (gate_up[i] != weight_value(view.moe_layer_idx, expert_idx, static_cast<int64_t>(i))) return false;
  }
  for (size_t i = 0; i < down.size(); ++i) {
    if (down[i] != weight_value(view.moe_layer_idx, expert_idx, 1000 + static_cast<int64_t>(i))) return false;
  }
  return true;
}

inline eplb::Placement random_placement(std::mt19937& rng, const eplb::Topology& topo, int num_layers, int num_experts) {
  eplb::Placement placement(topo, num_layers, num_experts);
  std::uniform_int_distribution<int> any_expert(0, num_experts - 1);
  for (int l = 0; l < num_layers; ++l) {
    auto row = placement.layer(l);
    for (int s = 0; s < topo.num_physical_experts; ++s) row[s] = s < num_experts ? s : any_expert(rng);
    std::shuffle(row.begin(), row.end(), rng);
  }
  placement.validate();
  return placement;
}

// Bytes of one synthetic slot (gate_up and down, fp32).
inline int64_t slot_bytes_of_synthetic() { return (2 * kWidth * kHidden + kHidden * kWidth) * 4; }

}  // namespace fulcrum::eplb_runtime::test
