#pragma once
// Helpers of the GPU MoE layer tests (moe_layer_test.cpp, nccl_ep_moe_layer_test.cpp): host <-> device
// copies, bf16 bits, layer maps with replicas, router logits with an expert that never wins, and the
// per-slot weights of a layer map.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu/kernels/expert_skinny_gemm.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "model/checkpoint_writer.hpp"
#include "moe_test_util.hpp"

namespace fulcrum::test {

// ||gpu - reference|| / ||reference|| bound of a bf16 MoE layer output: both round to bf16 at the same points and
// differ only where fp32 sums in another order cross a bf16 rounding boundary.
constexpr double kBf16Tolerance = 1e-3;

inline std::vector<uint16_t> to_bits(const std::vector<float>& v) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = model::f32_to_bf16_bits(v[i]);
  return bits;
}

inline std::vector<float> to_floats(const std::vector<uint16_t>& bits) {
  std::vector<float> v(bits.size());
  for (size_t q = 0; q < bits.size(); ++q) v[q] = model::bf16_bits_to_f32(bits[q]);
  return v;
}

template <typename T>
backend::DeviceBuffer to_device(const std::vector<T>& host) {
  backend::DeviceBuffer buf(sizeof(T) * std::max<size_t>(host.size(), 1));
  EXPECT_EQ(cudaMemcpy(buf.as<T>(), host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  // From pageable memory cudaMemcpy may return before its DMA lands, and the layers' non-blocking streams do
  // not wait for the legacy stream: without this, a kernel could read part of the old contents.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return buf;
}

template <typename T>
std::vector<T> to_host(const T* device, int64_t n) {
  std::vector<T> host(static_cast<size_t>(n));
  EXPECT_EQ(cudaMemcpy(host.data(), device, sizeof(T) * host.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

// The weights of `slots` slots (gate_up [slots][gate_up_size], down [slots][down_size], values as stored) held in
// reverse slot order in device buffers other than a layer's own, and per-slot pointer lists into them: slot s of
// pointers(shift) points at the weights of slot (s + shift) % slots.
struct ReversedSlotWeights {
  ReversedSlotWeights(const std::vector<float>& gate_up, const std::vector<float>& down, int slots, int64_t gate_up_size,
                      int64_t down_size)
      : num_slots(slots), gate_up_elems(gate_up_size), down_elems(down_size) {
    std::vector<float> g, d;
    for (int s = slots - 1; s >= 0; --s) {
      g.insert(g.end(), gate_up.begin() + s * gate_up_size, gate_up.begin() + (s + 1) * gate_up_size);
      d.insert(d.end(), down.begin() + s * down_size, down.begin() + (s + 1) * down_size);
    }
    d_gate_up = to_device(to_bits(g));
    d_down = to_device(to_bits(d));
  }
  std::pair<std::vector<const uint16_t*>, std::vector<const uint16_t*>> pointers(int shift) const {
    std::pair<std::vector<const uint16_t*>, std::vector<const uint16_t*>> ptrs;
    for (int s = 0; s < num_slots; ++s) {
      const int held = num_slots - 1 - (s + shift) % num_slots;  // where slot (s + shift)'s weights lie
      ptrs.first.push_back(d_gate_up.as<uint16_t>() + held * gate_up_elems);
      ptrs.second.push_back(d_down.as<uint16_t>() + held * down_elems);
    }
    return ptrs;
  }
  int num_slots;
  int64_t gate_up_elems, down_elems;
  backend::DeviceBuffer d_gate_up, d_down;
};

inline backend::MoeLayerShape moe_shape(int hidden, int intermediate, int experts, int top_k, int slots,
                                        int64_t max_tokens) {
  backend::MoeLayerShape shape;
  shape.hidden_size = hidden;
  shape.moe_intermediate_size = intermediate;
  shape.num_experts = experts;
  shape.num_experts_per_tok = top_k;
  shape.num_slots = slots;
  shape.max_tokens = max_tokens;
  return shape;
}

// Bitwise equality of two outputs; when they differ, how many values and by how much (so a failure tells
// rounding-level nondeterminism from garbage).
inline ::testing::AssertionResult bitwise_equal(const std::vector<float>& actual, const std::vector<float>& expected) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << actual.size() << " values, expected " << expected.size();
  }
  int64_t differ = 0;
  double worst = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (std::memcmp(&actual[i], &expected[i], sizeof(float)) == 0) continue;
    ++differ;
    worst = std::max(worst, std::abs(double(actual[i]) - expected[i]));
  }
  if (differ == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << differ << " of " << actual.size() << " values differ, largest |difference| "
                                       << worst << ", relative error " << relative_error(actual, expected);
}

// A layer map with P = E + extra slots: every expert once, then replicas of the first experts (hot ones in
// a real placement), shuffled so replicas land on different GPUs.
inline std::vector<int32_t> layer_map_for(int experts, int extra, uint32_t seed) {
  std::vector<int32_t> map(static_cast<size_t>(experts + extra));
  for (int s = 0; s < experts + extra; ++s) map[s] = s < experts ? s : (s - experts) % experts;
  std::mt19937 rng(seed);
  std::shuffle(map.begin(), map.end(), rng);
  return map;
}

// Random logits [T, E]; expert 3 never wins (a slot, or several, with zero tokens).
inline std::vector<float> random_logits(int64_t tokens, int experts, uint32_t seed) {
  std::vector<float> logits = random_bf16_values(tokens * experts, seed, 4.0f);
  for (int64_t t = 0; t < tokens; ++t) logits[static_cast<size_t>(t * experts + 3)] = -30.0f;
  return logits;
}

// Random bf16 weights of a layer: router [E, H], logical experts' gate_up [E, 2I, H] / down [E, H, I], and
// the slots' copies [P, ...] of their logical expert (as after an EPLB migration).
struct MoeWeights {
  std::vector<float> router, logical_gate_up, logical_down, gate_up, down;
};

inline MoeWeights random_moe_weights(int hidden, int intermediate, int experts, const std::vector<int32_t>& map,
                                     uint32_t seed) {
  const int64_t h = hidden, i = intermediate;
  MoeWeights w;
  w.router = random_bf16_values(experts * h, seed, 1.0f / std::sqrt(float(h)));
  w.logical_gate_up = random_bf16_values(experts * 2 * i * h, seed + 1, 1.0f / std::sqrt(float(h)));
  w.logical_down = random_bf16_values(experts * h * i, seed + 2, 1.0f / std::sqrt(float(i)));
  for (const int32_t e : map) {
    w.gate_up.insert(w.gate_up.end(), w.logical_gate_up.begin() + e * 2 * i * h, w.logical_gate_up.begin() + (e + 1) * 2 * i * h);
    w.down.insert(w.down.end(), w.logical_down.begin() + e * h * i, w.logical_down.begin() + (e + 1) * h * i);
  }
  return w;
}

// Slots [begin, begin + count) of per-slot weights of `per_slot` values each.
inline std::vector<float> slot_range(const std::vector<float>& all, int begin, int count, int64_t per_slot) {
  return {all.begin() + begin * per_slot, all.begin() + (begin + count) * per_slot};
}

// The MoE layer's two expert skinny GEMMs over one plan: gate_up + SwiGLU from x [*, h] (rows read through
// row_source) into act [rows, i], then down from act into out [rows, h].
struct ExpertGemms {
  gpu::ExpertSkinnyArgs gate_up, down;
};
inline ExpertGemms expert_gemms(const uint16_t* x, const int32_t* row_source, const int32_t* offsets,
                                const int32_t* active, const backend::DeviceBuffer& gate_up_ptrs,
                                const backend::DeviceBuffer& down_ptrs, int h, int i, int max_rows, int num_slots,
                                uint16_t* act, uint16_t* out) {
  ExpertGemms g;
  gpu::ExpertSkinnyArgs& a = g.gate_up;
  a.x = x;
  a.row_source = row_source;
  a.offsets = offsets;
  a.active = active;
  a.weights = gate_up_ptrs.as<const uint16_t* const>();
  a.n = i;
  a.k = h;
  a.max_rows = max_rows;
  a.num_slots = num_slots;
  a.swiglu = true;
  a.out = act;
  gpu::ExpertSkinnyArgs& b = g.down;
  b = a;
  b.x = act;
  b.row_source = nullptr;
  b.weights = down_ptrs.as<const uint16_t* const>();
  b.n = h;
  b.k = i;
  b.swiglu = false;
  b.out = out;
  return g;
}

}  // namespace fulcrum::test
