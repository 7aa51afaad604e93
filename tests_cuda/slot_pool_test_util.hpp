#pragma once
// Checks shared by the slot pool tests: a layer's slots hold the generated weights of given logical experts.
#include <gtest/gtest.h>

#include <span>
#include <vector>

#include "gpu/moe/gpu_slot_pool.hpp"
#include "model/random_weights.hpp"

namespace fulcrum::test {

// Generated (gate_up, down) of one logical expert, as GpuSlotPool::fill_layer writes them.
inline std::pair<std::vector<uint16_t>, std::vector<uint16_t>> expected_expert(const backend::GpuSlotPool& pool,
                                                                               int layer_idx, int expert, uint64_t seed) {
  const int h = pool.shape().hidden_size, i = pool.shape().moe_intermediate_size;
  return {model::expert_weights_reference(seed, layer_idx, expert, model::ExpertTensor::kGateUp, h, i),
          model::expert_weights_reference(seed, layer_idx, expert, model::ExpertTensor::kDown, h, i)};
}

// Every local slot s of the layer holds logical expert experts[s]'s weights, bit for bit.
inline void expect_slots_hold(const backend::GpuSlotPool& pool, int layer_idx, std::span<const int32_t> experts,
                              uint64_t seed) {
  for (size_t s = 0; s < experts.size(); ++s) {
    EXPECT_TRUE(pool.download_slot(layer_idx, static_cast<int>(s)) == expected_expert(pool, layer_idx, experts[s], seed))
        << "layer " << layer_idx << " slot " << s << " should hold expert " << experts[s];
  }
}

}  // namespace fulcrum::test
