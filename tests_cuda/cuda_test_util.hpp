#pragma once
// The CUDA-vs-CPU comparison fixture shared by the CUDA test files: the same values on both backends and
// the scaled error (|cuda - cpu| / max(1, |cpu|)) within a per-op tolerance (cuda_backend_test.cpp lists
// and justifies them). Every test skips when no CUDA device is present.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cuda/cuda_backend.hpp"

namespace fulcrum::test {

using model::Tensor;

constexpr float kExact = 0.0f;
constexpr float kNormTolerance = 1e-6f;
constexpr float kRouteWeightTolerance = 1e-6f;
constexpr float kElementwiseTolerance = 1e-5f;
constexpr float kMatmulTolerance = 1e-4f;
constexpr float kAttentionTolerance = 1e-4f;

inline std::vector<float> random_values(int64_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) v = dist(rng);
  return values;
}

// max_i |actual_i - expected_i| / max(1, |expected_i|).
inline float scaled_error(const std::vector<float>& actual, const std::vector<float>& expected) {
  EXPECT_EQ(actual.size(), expected.size());
  float worst = 0;
  for (size_t i = 0; i < std::min(actual.size(), expected.size()); ++i) {
    const float err = std::abs(actual[i] - expected[i]) / std::max(1.0f, std::abs(expected[i]));
    worst = std::max(worst, std::isnan(err) ? INFINITY : err);
  }
  return worst;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) {
      GTEST_SKIP() << "no CUDA device: the CUDA backend tests need a GPU (run build-cuda/bin/fulcrum_cuda_tests there)";
    }
    cuda_ = std::make_unique<backend::CudaBackend>();
  }

  // The same values on both backends.
  std::pair<Tensor, Tensor> both(const std::vector<int64_t>& shape, const std::vector<float>& values) {
    Tensor on_cpu = cpu_.zeros(shape);
    cpu_.upload(on_cpu, values);
    Tensor on_cuda = cuda_->zeros(shape);
    cuda_->upload(on_cuda, values);
    return {on_cpu, on_cuda};
  }
  std::pair<Tensor, Tensor> random_both(const std::vector<int64_t>& shape, uint32_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    return both(shape, random_values(n, seed, lo, hi));
  }
  // Compares a CUDA result with the CPU one: same shape, scaled error within `tolerance`.
  void expect_close(const Tensor& on_cuda, const Tensor& on_cpu, float tolerance, const std::string& what) {
    EXPECT_EQ(on_cuda.shape(), on_cpu.shape()) << what;
    const float err = scaled_error(cuda_->download(on_cuda), cpu_.download(on_cpu));
    EXPECT_LE(err, tolerance) << what;
  }

  backend::CpuBackend cpu_;
  std::unique_ptr<backend::CudaBackend> cuda_;
};

}  // namespace fulcrum::test
