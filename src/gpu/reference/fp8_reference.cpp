#include "gpu/reference/fp8_reference.hpp"

#include <array>
#include <cmath>
#include <vector>

#include "model/checkpoint_writer.hpp"  // f32_to_f8e4m3_bits, f32_to_bf16_bits, bf16_bits_to_f32
#include "model/safetensors.hpp"        // f8e4m3_to_f32

namespace fulcrum::gpu::reference {
namespace {

constexpr float kE4m3Max = 448.0f;

// Every e4m3 code's value (NaN codes 0x7f / 0xff included, as the GPU would read them).
std::array<double, 256> e4m3_values() {
  std::array<double, 256> values{};
  for (int c = 0; c < 256; ++c) values[c] = model::f8e4m3_to_f32(static_cast<uint8_t>(c));
  return values;
}

// Quantizes one row's 128-column block `values` (fp32 copies of bf16 values) into q, returns its scale.
float quantize_block(const float* values, uint8_t* q) {
  float amax = 0.0f;
  for (int c = 0; c < kFp8Block; ++c) amax = std::fmax(amax, std::abs(values[c]));  // fmax: as the GPU's fmaxf
  if (!(amax > 0.0f)) {
    for (int c = 0; c < kFp8Block; ++c) q[c] = 0;
    return 0.0f;
  }
  const float inv = kE4m3Max / amax;  // one IEEE fp32 division
  for (int c = 0; c < kFp8Block; ++c) {
    const float scaled = values[c] * inv;  // one fp32 rounding
    q[c] = model::f32_to_f8e4m3_bits(scaled);
  }
  return amax / kE4m3Max;
}

}  // namespace

void quantize_rows_fp8(std::span<const uint16_t> x, int cols, std::span<const int32_t> offsets, std::span<uint8_t> q,
                       std::span<float> scales) {
  const int k_blocks = cols / kFp8Block;
  std::vector<float> block(kFp8Block);
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t first = offsets[g], rows_in_group = int64_t{offsets[g + 1]} - first;
    for (int64_t r = first; r < first + rows_in_group; ++r) {
      for (int kb = 0; kb < k_blocks; ++kb) {
        const int64_t c0 = r * cols + int64_t{kb} * kFp8Block;
        for (int c = 0; c < kFp8Block; ++c) block[c] = model::bf16_bits_to_f32(x[c0 + c]);
        scales[first * k_blocks + kb * rows_in_group + (r - first)] = quantize_block(block.data(), q.data() + c0);
      }
    }
  }
}

void swiglu_bf16(std::span<const uint16_t> h, int cols, std::span<const int32_t> offsets, std::span<uint16_t> a) {
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
      const uint16_t* h_row = h.data() + r * 2 * cols;  // [2 cols]: gate | up
      for (int c = 0; c < cols; ++c) {
        const float gate = model::bf16_bits_to_f32(h_row[c]), up = model::bf16_bits_to_f32(h_row[cols + c]);
        a[r * cols + c] = model::f32_to_bf16_bits(gate / (1.0f + std::exp(-gate)) * up);
      }
    }
  }
}

void swiglu_quantize_fp8(std::span<const uint16_t> h, int cols, std::span<const int32_t> offsets, std::span<uint8_t> q,
                         std::span<float> scales) {
  const int64_t rows = offsets.empty() ? 0 : offsets.back();
  std::vector<uint16_t> a(static_cast<size_t>(rows > 0 ? rows * cols : 0));
  swiglu_bf16(h, cols, offsets, a);
  quantize_rows_fp8(a, cols, offsets, q, scales);
}

void fp8_grouped_gemm(std::span<const uint8_t> a, std::span<const float> a_scales, std::span<const int32_t> offsets,
                      std::span<const uint8_t> b, std::span<const float> b_scales, int num_b, int n, int k,
                      std::span<float> d, std::span<float> abs_sums) {
  static const std::array<double, 256> value_of = e4m3_values();
  const int k_blocks = k / kFp8Block, n_blocks = n / kFp8Block;
  std::vector<double> a_row(static_cast<size_t>(k));  // [K] dequantized e4m3 values (unscaled)
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t first = offsets[g], rows_in_group = int64_t{offsets[g + 1]} - first;
    const int64_t w = static_cast<int64_t>(g % static_cast<size_t>(num_b));
    const uint8_t* b_g = b.data() + w * n * k;                  // [N, K]
    const float* sb_g = b_scales.data() + w * k_blocks * n_blocks;  // [Kb][N / 128]
    for (int64_t r = first; r < first + rows_in_group; ++r) {
      for (int q = 0; q < k; ++q) a_row[q] = value_of[a[r * k + q]];
      const float* sa_r = a_scales.data() + first * k_blocks + (r - first);  // sa(r, kb) = sa_r[kb * m]
      for (int col = 0; col < n; ++col) {
        const uint8_t* b_row = b_g + int64_t{col} * k;
        double sum = 0, abs_sum = 0;
        for (int kb = 0; kb < k_blocks; ++kb) {
          // e4m3 values are multiples of 2^-9 below 2^9, so every partial sum of a block's products is a
          // multiple of 2^-18 below 2^25: exact in a double in any order (4 accumulators for speed).
          double part[4] = {}, abs_part[4] = {};
          for (int q = kb * kFp8Block; q < (kb + 1) * kFp8Block; q += 4) {
            for (int j = 0; j < 4; ++j) {
              const double term = a_row[q + j] * value_of[b_row[q + j]];
              part[j] += term;
              abs_part[j] += std::abs(term);
            }
          }
          const double block = (part[0] + part[1]) + (part[2] + part[3]);
          const double abs_block = (abs_part[0] + abs_part[1]) + (abs_part[2] + abs_part[3]);
          const double scale = double(sa_r[kb * rows_in_group]) * double(sb_g[kb * n_blocks + col / kFp8Block]);
          sum += scale * block;
          abs_sum += std::abs(scale) * abs_block;
        }
        d[r * n + col] = static_cast<float>(sum);
        if (!abs_sums.empty()) abs_sums[r * n + col] = static_cast<float>(abs_sum);
      }
    }
  }
}

}  // namespace fulcrum::gpu::reference
