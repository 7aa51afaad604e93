#pragma once
// Where physical expert slots live: slot s is on GPU s / slots_per_gpu, GPU g on node g / gpus_per_node.
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
  }
};

}  // namespace fulcrum::eplb
