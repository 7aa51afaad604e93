#include "model/backend.hpp"

#include <cmath>

#include "eplb/error.hpp"

namespace fulcrum::model {

void check_write_kv(const Tensor& cache, const Tensor& src, int64_t start_pos) {
  FULCRUM_CHECK(start_pos >= 0 && start_pos + src.dim(0) <= cache.dim(0),
                "kv cache of capacity {} cannot take positions [{}, {})", cache.dim(0), start_pos,
                start_pos + src.dim(0));
  FULCRUM_CHECK(src.row_numel() == cache.row_numel(), "kv cache rows hold {} values, source rows {}",
                cache.row_numel(), src.row_numel());
}

std::vector<float> rope_inv_freq(int64_t head_dim, double rope_theta) {
  const int64_t half = head_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv_freq[i] = 1.0f / std::pow(static_cast<float>(rope_theta), exponent);
  }
  return inv_freq;
}

}  // namespace fulcrum::model
