#pragma once
// Random operands, device round trips, bf16 spacing and the timing loop shared by the skinny GEMM tests
// (gpu_skinny_gemm_test.cpp, gpu_skinny_gemm_fp8_test.cpp, gpu_expert_skinny_fp8_test.cpp).
#include <algorithm>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu/moe/moe_layer.hpp"
#include "model/checkpoint_writer.hpp"
#include "model/safetensors.hpp"

namespace fulcrum::test::skinny_test {

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

inline std::vector<uint16_t> random_bf16(size_t count, uint64_t seed) {
  SplitMix rng{seed};
  std::vector<uint16_t> bits(count);
  for (uint16_t& b : bits) b = model::f32_to_bf16_bits(2.0f * rng.unit() - 1.0f);
  return bits;
}

// Every e4m3 byte but the two NaNs (S.1111.111), equally likely.
inline std::vector<uint8_t> random_e4m3(size_t count, uint64_t seed) {
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

inline std::vector<float> random_scales(size_t count, uint64_t seed) {
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

inline float bf16_spacing_above(float magnitude) {
  const uint16_t bits = model::f32_to_bf16_bits(magnitude);
  return model::bf16_bits_to_f32(static_cast<uint16_t>(bits + 1)) - model::bf16_bits_to_f32(bits);
}

// Median microseconds of 50 timed calls of `run(copy)` after 5 warm-up calls; copies cycle so that, as in decode
// (every layer its own weights), the weights come from HBM and not from L2.
template <typename Run>
double median_us(cudaStream_t stream, int copies, Run run) {
  constexpr int kWarmup = 5, kSamples = 50;
  for (int i = 0; i < kWarmup; ++i) run(i % copies);
  std::vector<cudaEvent_t> starts(kSamples), stops(kSamples);
  for (int i = 0; i < kSamples; ++i) {
    EXPECT_EQ(cudaEventCreate(&starts[i]), cudaSuccess);
    EXPECT_EQ(cudaEventCreate(&stops[i]), cudaSuccess);
  }
  for (int i = 0; i < kSamples; ++i) {
    EXPECT_EQ(cudaEventRecord(starts[i], stream), cudaSuccess);
    run((kWarmup + i) % copies);
    EXPECT_EQ(cudaEventRecord(stops[i], stream), cudaSuccess);
  }
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<double> us(kSamples);
  for (int i = 0; i < kSamples; ++i) {
    float ms = 0;
    EXPECT_EQ(cudaEventElapsedTime(&ms, starts[i], stops[i]), cudaSuccess);
    us[i] = 1e3 * ms;
    EXPECT_EQ(cudaEventDestroy(starts[i]), cudaSuccess);
    EXPECT_EQ(cudaEventDestroy(stops[i]), cudaSuccess);
  }
  std::nth_element(us.begin(), us.begin() + kSamples / 2, us.end());
  return us[kSamples / 2];
}

}  // namespace fulcrum::test::skinny_test
