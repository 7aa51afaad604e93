#pragma once
// Deterministic pseudo-random bf16 weights, the CPU reference of cuda::moe::launch_fill_random_bf16: value i of
// a fill with `seed` is output i + 1 of splitmix64 started at `seed` (the kernel hashes seed + (i + 1) * golden,
// the same number), its top 24 bits u in [0, 1) mapped to bf16((2u - 1) * scale), round to nearest even.
// Expert weights for the slot pool are such fills, one per (seed, layer, logical expert, tensor), so a
// slot's expected contents follow from the logical expert it holds (tests and benchmarks build and check
// weights without host copies).
#include <cstdint>
#include <vector>

namespace fulcrum::model {

std::vector<uint16_t> random_bf16_reference(int64_t n, uint64_t seed, float scale);
// The FP8 twin (cuda::moe::launch_fill_random_e4m3): the same stream's u mapped to e4m3((2u - 1) * 448), round
// to nearest even; with a block scale s every weight is uniform in +-448 s.
std::vector<uint8_t> random_e4m3_reference(int64_t n, uint64_t seed);

// The tensors of one expert: gate_up [2I, H] (gate rows, then up rows) and down [H, I].
enum class ExpertTensor : int { kGateUp = 0, kDown = 1 };

// Seed of one expert tensor's fill: distinct streams per (layer, logical expert, tensor) under one seed.
uint64_t expert_weight_seed(uint64_t seed, int layer_idx, int expert_idx, ExpertTensor tensor);
// Fill scale, as GpuMoeLayer::randomize_weights: 1/sqrt(fan_in), fan_in = H for gate_up, I for down.
float expert_weight_scale(ExpertTensor tensor, int hidden_size, int moe_intermediate_size);

// Block scale of a generated FP8 expert tensor (GpuSlotPool::fill_layer, FP8 pools): the fill scale / 448, times
// 1, 1.25, 1.5 or 1.75 by expert % 4, so experts differ in their scales too (a scale left behind shows).
float expert_fp8_block_scale(ExpertTensor tensor, int hidden_size, int moe_intermediate_size, int expert_idx);

// The reference weights of one expert tensor: [2I * H] for gate_up, [H * I] for down (bf16 bits).
std::vector<uint16_t> expert_weights_reference(uint64_t seed, int layer_idx, int expert_idx, ExpertTensor tensor,
                                               int hidden_size, int moe_intermediate_size);

}  // namespace fulcrum::model
