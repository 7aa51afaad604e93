#pragma once
// Random operands and device round trips shared by the FP8 skinny GEMM tests (gpu_skinny_gemm_fp8_test.cpp,
// gpu_expert_skinny_fp8_test.cpp).
#include <algorithm>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu/moe/moe_layer.hpp"
#include "model/checkpoint_writer.hpp"

namespace fulcrum::test::fp8_skinny {

using backend::DeviceBuffer;

// splitmix64: fast enough for 300 MB of weights.
struct SplitMix {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float unit() { return static_cast<float>(next() >> 40) * 0x1p-24f; }  // [0, 1)
};

std::vector<uint16_t> random_bf16(size_t count, uint64_t seed) {
  SplitMix rng{seed};
  std::vector<uint16_t> bits(count);
  for (uint16_t& b : bits) b = model::f32_to_bf16_bits(2.0f * rng.unit() - 1.0f);
  return bits;
}

// Every e4m3 byte but the two NaNs (S.1111.111), equally likely.
std::vector<uint8_t> random_e4m3(size_t count, uint64_t seed) {
  SplitMix rng{seed};
  std::vector<uint8_t> bytes(count);
  for (size_t q = 0; q < count; q += 8) {
    uint64_t z = rng.next();
    for (size_t b = q; b < std::min(count, q + 8); ++b, z >>= 8) {
      bytes[b] = static_cast<uint8_t>(z);
      if ((bytes[b] & 0x7f) == 0x7f) bytes[b] ^= 0x01;  // NaN -> +-416
    }
  }
  return bytes;
}

std::vector<float> random_scales(size_t count, uint64_t seed) {
  SplitMix rng{seed};
  std::vector<float> scales(count);
  for (float& s : scales) s = (0.5f + rng.unit()) / 1024.0f;
  return scales;
}

template <typename T>
DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer buf(sizeof(T) * std::max<size_t>(host.size(), 1));
  EXPECT_EQ(cudaMemcpy(buf.as<T>(), host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  return buf;
}
template <typename T>
std::vector<T> download(const T* device, size_t count) {
  std::vector<T> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), device, sizeof(T) * count, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

}  // namespace fulcrum::test::fp8_skinny
