#pragma once
// Working state of the fulcrum planner for one layer: which expert each slot holds, replica counts,
// per-GPU loads and per-(expert, GPU) replica counts, with the two edits the planner makes:
// swapping the experts of two slots and reassigning one slot to another expert.
// Loads follow metrics.hpp: a replica of expert e carries load[e] / count[e].
// Scratch buffers are reused across calls (one Layout per thread), so the hot path does not allocate.
#include <cstdint>
#include <span>
#include <vector>

namespace fulcrum::eplb::fulcrum_detail {

struct Layout {
  int num_experts = 0;
  int num_slots = 0;
  int num_gpus = 0;
  int slots_per_gpu = 0;
  int cap = 0;             // most replicas an expert may get: num_gpus when P <= E * G, else unbounded
  bool allow_dup = false;  // true only when P > E * G: two replicas on one GPU cannot be avoided
  std::span<const double> load;    // [E] expert loads
  std::vector<int32_t> expert;     // [P] slot -> expert
  std::vector<int> count;          // [E]
  std::vector<double> slot_w;      // [P] load of the replica in each slot
  std::vector<double> gpu_load;    // [G]
  std::vector<uint16_t> hosted;    // [E * G] replicas of expert e on GPU g, at e * G + g

  // Sizes the buffers for E = load.size(), P slots and G GPUs (contents undefined until rebuild()).
  void reset(std::span<const double> expert_load, int slots, int gpus);
  // Recomputes counts, slot weights, GPU loads and `hosted` from `expert`.
  void rebuild();

  int gpu_of(int slot) const { return slot / slots_per_gpu; }
  double replica_w(int e) const { return load[e] / count[e]; }
  int on(int e, int g) const { return hosted[static_cast<size_t>(e) * num_gpus + g]; }
  // Heaviest GPU in [g0, g1), lowest index on ties.
  int heaviest(int g0, int g1) const;
  int heaviest() const { return heaviest(0, num_gpus); }
  double max_load() const { return gpu_load[heaviest()]; }

  void swap_slots(int s1, int s2);
  // Slot s now holds expert a (its old expert must keep at least one replica).
  void reassign(int s, int a);

 private:
  void refresh_weight(int e);  // slot_w of every replica of e after its count changed
};

}  // namespace fulcrum::eplb::fulcrum_detail
