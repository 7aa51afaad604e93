#include "gpu/reference/skinny_gemm_reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "model/parallel_chunks.hpp"

namespace fulcrum::gpu::reference {
namespace {
float bf16_to_f32(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// e4m3 (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities, S.1111.111 is NaN).
double e4m3_value(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::nan("");
  const double magnitude = exponent == 0 ? std::ldexp(mantissa, -9)  // subnormal: mantissa / 8 * 2^-6
                                         : std::ldexp(8 + mantissa, exponent - 10);  // (1 + m / 8) * 2^(e - 7)
  return bits & 0x80 ? -magnitude : magnitude;
}
}  // namespace

void skinny_gemm(std::span<const uint16_t> x, std::span<const uint16_t> w, int m, int n, int k, std::span<float> out,
                 std::span<float> abs_sums) {
  std::vector<double> xs(static_cast<size_t>(m) * k);  // [m, k]
  for (size_t q = 0; q < xs.size(); ++q) xs[q] = bf16_to_f32(x[q]);
  model::parallel_chunks(n, int64_t{m} * k, [&](int64_t j_begin, int64_t j_end) {
    std::vector<double> w_row(static_cast<size_t>(k));
    for (int64_t j = j_begin; j < j_end; ++j) {
      const uint16_t* src = w.data() + static_cast<size_t>(j) * k;
      for (int q = 0; q < k; ++q) w_row[q] = bf16_to_f32(src[q]);
      for (int i = 0; i < m; ++i) {
        const double* xi = xs.data() + static_cast<size_t>(i) * k;
        double sum = 0, abs_sum = 0;
        for (int q = 0; q < k; ++q) {
          sum += xi[q] * w_row[q];
          abs_sum += std::abs(xi[q] * w_row[q]);
        }
        out[static_cast<size_t>(i) * n + j] = static_cast<float>(sum);
        if (!abs_sums.empty()) abs_sums[static_cast<size_t>(i) * n + j] = static_cast<float>(abs_sum);
      }
    }
  });
}

void skinny_gemm_fp8(std::span<const uint16_t> x, std::span<const uint8_t> w, std::span<const float> w_scales, int m,
                     int n, int k, std::span<float> out, std::span<float> abs_sums) {
  constexpr int kBlock = 128;
  const int k_blocks = (k + kBlock - 1) / kBlock, n_blocks = (n + kBlock - 1) / kBlock;
  double e4m3_of[256];
  for (int b = 0; b < 256; ++b) e4m3_of[b] = e4m3_value(static_cast<uint8_t>(b));
  std::vector<double> xs(static_cast<size_t>(m) * k);  // [m, k]
  for (size_t q = 0; q < xs.size(); ++q) xs[q] = bf16_to_f32(x[q]);
  model::parallel_chunks(n, int64_t{m} * k, [&](int64_t j_begin, int64_t j_end) {
    std::vector<double> w_row(static_cast<size_t>(k));
    for (int64_t j = j_begin; j < j_end; ++j) {
      const uint8_t* src = w.data() + static_cast<size_t>(j) * k;
      for (int q = 0; q < k; ++q) w_row[q] = e4m3_of[src[q]];
      for (int i = 0; i < m; ++i) {
        const double* xi = xs.data() + static_cast<size_t>(i) * k;
        double sum = 0, abs_sum = 0;
        for (int b = 0; b < k_blocks; ++b) {
          const double scale = w_scales[static_cast<size_t>(b) * n_blocks + j / kBlock];
          double block_sum = 0, block_abs = 0;
          for (int q = b * kBlock; q < std::min(k, (b + 1) * kBlock); ++q) {
            block_sum += xi[q] * w_row[q];
            block_abs += std::abs(xi[q] * w_row[q]);
          }
          sum += scale * block_sum;
          abs_sum += std::abs(scale) * block_abs;
        }
        out[static_cast<size_t>(i) * n + j] = static_cast<float>(sum);
        if (!abs_sums.empty()) abs_sums[static_cast<size_t>(i) * n + j] = static_cast<float>(abs_sum);
      }
    }
  });
}

}  // namespace fulcrum::gpu::reference
