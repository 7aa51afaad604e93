#pragma once
// Where physical expert slots live: slot s is on GPU s / slots_per_gpu, GPU g on node g / gpus_per_node.
#include <algorithm>
#include <cstdint>

#include "eplb/error.hpp"

namespace fulcrum::eplb {

struct Topology {
  int num_physical_experts = 0;  // P: slots per MoE layer, over all GPUs
  int num_gpus = 1;              // G: expert-parallel ranks
  int num_nodes = 1;             // N: G / N GPUs per node

  int slots_per_gpu() const { return num_physical_experts / num_gpus; }
  int gpus_per_node() const { return num_gpus / num_nodes; }
  int gpu_of_slot(int slot_idx) const { return slot_idx / slots_per_gpu(); }
  int node_of_gpu(int gpu_idx) const { return gpu_idx / gpus_per_node(); }
  int node_of_slot(int slot_idx) const { return node_of_gpu(gpu_of_slot(slot_idx)); }

  // NOTES: what a placement can be, checked before anything is sized by these numbers (a flag of 2e9 slots once
  // allocated until the OOM killer came). Slots per layer: at most kMaxReplicasPerExpert x max(logical experts,
  // GPUs) (64 replicas per expert on average, or 64 slots per GPU where GPUs outnumber experts: one expert on 128
  // GPUs is a placement) and at most kMaxPhysicalExperts; GPUs <= slots and nodes <= GPUs follow from the
  // divisibility rules.
  // A whole map (layers x slots) holds at most kMaxMapEntries int32 (256 MiB).
  static constexpr int kMaxReplicasPerExpert = 64;
  static constexpr int kMaxPhysicalExperts = 1 << 20;
  static constexpr int64_t kMaxMapEntries = int64_t{1} << 26;

  // Throws fulcrum::Error naming the broken rule.
  void validate(int num_logical_experts) const {
    FULCRUM_CHECK(num_gpus > 0, "num_gpus must be positive, got {}", num_gpus);
    FULCRUM_CHECK(num_nodes > 0, "num_nodes must be positive, got {}", num_nodes);
    FULCRUM_CHECK(num_gpus % num_nodes == 0, "num_gpus ({}) must be divisible by num_nodes ({})", num_gpus,
                  num_nodes);
    FULCRUM_CHECK(num_physical_experts > 0 && num_physical_experts % num_gpus == 0,
                  "physical experts ({}) must be a positive multiple of num_gpus ({})", num_physical_experts,
                  num_gpus);
    FULCRUM_CHECK(num_physical_experts >= num_logical_experts,
                  "physical experts ({}) must be at least the number of logical experts ({})",
                  num_physical_experts, num_logical_experts);
    const int64_t relative_cap = int64_t{kMaxReplicasPerExpert} * std::max(num_logical_experts, num_gpus);
    FULCRUM_CHECK(num_physical_experts <= relative_cap && num_physical_experts <= kMaxPhysicalExperts,
                  "physical experts ({}) must be at most {} x max(logical experts {}, GPUs {}) = {} and at most {}",
                  num_physical_experts, kMaxReplicasPerExpert, num_logical_experts, num_gpus, relative_cap,
                  kMaxPhysicalExperts);
  }
  // The rules above, and num_layers x num_physical_experts within kMaxMapEntries.
  void validate(int num_logical_experts, int num_layers) const {
    validate(num_logical_experts);
    FULCRUM_CHECK(num_layers > 0 && int64_t{num_layers} * num_physical_experts <= kMaxMapEntries,
                  "{} layers x {} physical experts must be positive and at most {} map entries", num_layers,
                  num_physical_experts, kMaxMapEntries);
  }
};

}  // namespace fulcrum::eplb
