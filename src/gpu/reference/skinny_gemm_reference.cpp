#include "gpu/reference/skinny_gemm_reference.hpp"

#include <cmath>
#include <cstring>
#include <vector>

namespace fulcrum::gpu::reference {
namespace {
float bf16_to_f32(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}
}  // namespace

void skinny_gemm(std::span<const uint16_t> x, std::span<const uint16_t> w, int m, int n, int k, std::span<float> out,
                 std::span<float> abs_sums) {
  std::vector<double> xs(static_cast<size_t>(m) * k);  // [m, k]
  for (size_t q = 0; q < xs.size(); ++q) xs[q] = bf16_to_f32(x[q]);
  std::vector<double> w_row(static_cast<size_t>(k));
  for (int j = 0; j < n; ++j) {
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
}

}  // namespace fulcrum::gpu::reference
