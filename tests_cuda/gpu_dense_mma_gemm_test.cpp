// The tensor-core dense GEMM for 1..32 rows (src/gpu/kernels/dense_mma_gemm.cu) against the skinny GEMM's CPU
// reference (src/gpu/reference/skinny_gemm_reference.hpp) on random bf16 inputs in [-1, 1): the Qwen3-30B-A3B decode
// projections (QKV 5120 x 2048, O 2048 x 4096, router 128 x 2048) and odd shapes (n not a multiple of 16, k not a
// multiple of 32, n = 1), m across the tile boundaries (1, 2, 8, 9, 16, 17, 24, 25, 32), fp32 and bf16 output, a
// poisoned guard past m x n. Row i must be bitwise the same for every m, the bf16 output exactly bf16(fp32 output).
//
// Tolerance: |gpu - ref| <= (k / 16 + 8) * 2^-23 * sum_k |x_k w_k|. The products of bf16 values are exact in fp32;
// each mma step adds 16 of them into an fp32 accumulator, and a tensor core's fp32 addition may truncate rather than
// round (up to 2^-23 relative per add, not IEEE's 2^-24); a K slice's k / 16 steps are split over two chains, then
// the chains, up to 3 slices and the reference's own rounding add a few more: k / 16 + 8 adds bound every path.
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/kernels/dense_mma_gemm.hpp"
#include "gpu/reference/skinny_gemm_reference.hpp"
#include "skinny_test_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using namespace skinny_test;

constexpr int kMaxRows = gpu::kDenseMmaMaxRows;
constexpr int kGuard = 64;

class DenseMmaGemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the tensor-core GEMM tests need a GPU";
  }
};

template <typename T>
std::vector<T> run_poisoned(const uint16_t* x, const uint16_t* w, int m, int n, int k, DeviceBuffer& out) {
  const size_t count = static_cast<size_t>(m) * n + kGuard;
  EXPECT_EQ(cudaMemset(out.as<T>(), 0xff, sizeof(T) * count), cudaSuccess);
  float* out_f32 = std::is_same_v<T, float> ? reinterpret_cast<float*>(out.as<T>()) : nullptr;
  uint16_t* out_bf16 = std::is_same_v<T, uint16_t> ? reinterpret_cast<uint16_t*>(out.as<T>()) : nullptr;
  EXPECT_EQ(gpu::launch_dense_mma_gemm(x, w, m, n, k, out_f32, out_bf16, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return download(out.as<T>(), count);
}

TEST_F(DenseMmaGemmTest, MatchesReferenceAndRowsDoNotDependOnM) {
  struct Shape {
    int n, k;
  };
  uint64_t seed = 101;
  for (const Shape shape : {Shape{5120, 2048}, Shape{2048, 4096}, Shape{128, 2048}, Shape{77, 328}, Shape{200, 1032},
                            Shape{1, 8}}) {
    const int n = shape.n, k = shape.k;
    SCOPED_TRACE(::testing::Message() << "n " << n << ", k " << k);
    const std::vector<uint16_t> x = random_bf16(static_cast<size_t>(kMaxRows) * k, seed++);
    const std::vector<uint16_t> w = random_bf16(static_cast<size_t>(n) * k, seed++);
    std::vector<float> ref(static_cast<size_t>(kMaxRows) * n), abs_sums(ref.size());
    gpu::reference::skinny_gemm(x, w, kMaxRows, n, k, ref, abs_sums);
    const double rel = (k / 16.0 + 8.0) * std::ldexp(1.0, -23);
    DeviceBuffer x_dev = upload(x), w_dev = upload(w);
    DeviceBuffer out_dev(sizeof(float) * (static_cast<size_t>(kMaxRows) * n + kGuard));
    std::vector<float> full;  // m = 32: every other m must give its rows bitwise
    for (const int m : {32, 25, 24, 17, 16, 9, 8, 2, 1}) {
      SCOPED_TRACE(::testing::Message() << "m " << m);
      const size_t count = static_cast<size_t>(m) * n;
      const std::vector<float> f32 = run_poisoned<float>(x_dev.as<uint16_t>(), w_dev.as<uint16_t>(), m, n, k, out_dev);
      const std::vector<uint16_t> bf16 =
          run_poisoned<uint16_t>(x_dev.as<uint16_t>(), w_dev.as<uint16_t>(), m, n, k, out_dev);
      if (m == kMaxRows) full = f32;
      int64_t off = 0, rounding = 0, variant = 0, guard = 0, first_off = -1;
      for (size_t q = 0; q < count; ++q) {
        if (!(std::abs(static_cast<double>(f32[q]) - ref[q]) <= rel * abs_sums[q]) && off++ == 0) first_off = q;
        if (bf16[q] != model::f32_to_bf16_bits(f32[q])) ++rounding;
        if (std::memcmp(&f32[q], &full[q], sizeof(float)) != 0) ++variant;
      }
      for (size_t q = count; q < count + kGuard; ++q) {
        uint32_t bits;
        std::memcpy(&bits, &f32[q], sizeof(bits));
        guard += bits != 0xffffffffu || bf16[q] != 0xffffu;
      }
      EXPECT_EQ(off, 0) << "first at " << first_off << ": " << (off ? f32[first_off] : 0.0f) << " vs "
                        << (off ? ref[first_off] : 0.0f);
      EXPECT_EQ(rounding, 0) << "bf16 output is not bf16(fp32 output)";
      EXPECT_EQ(variant, 0) << "rows differ from the m = 32 run";
      EXPECT_EQ(guard, 0) << "guard overwritten";
    }
  }
}

TEST_F(DenseMmaGemmTest, RefusesBadArguments) {
  const int n = 64, k = 64;
  DeviceBuffer x_dev = upload(random_bf16(static_cast<size_t>(kMaxRows) * k + 8, 111));
  DeviceBuffer w_dev = upload(random_bf16(static_cast<size_t>(n) * k + 8, 112));
  DeviceBuffer out_dev(sizeof(float) * (static_cast<size_t>(kMaxRows) * n + 8));
  const uint16_t* x = x_dev.as<uint16_t>();
  const uint16_t* w = w_dev.as<uint16_t>();
  float* out = out_dev.as<float>();
  const auto launch = [&](const uint16_t* xp, const uint16_t* wp, int m, int nn, int kk, float* of, uint16_t* ob) {
    return gpu::launch_dense_mma_gemm(xp, wp, m, nn, kk, of, ob, nullptr);
  };
  EXPECT_EQ(launch(x, w, 0, n, k, out, nullptr), cudaErrorInvalidValue) << "m = 0";
  EXPECT_EQ(launch(x, w, 33, n, k, out, nullptr), cudaErrorInvalidValue) << "m = 33";
  EXPECT_EQ(launch(x, w, 16, -1, k, out, nullptr), cudaErrorInvalidValue) << "n < 0";
  EXPECT_EQ(launch(x, w, 16, n, 60, out, nullptr), cudaErrorInvalidValue) << "k % 8 != 0";
  EXPECT_EQ(launch(x + 4, w, 16, n, k, out, nullptr), cudaErrorInvalidValue) << "x 8 bytes off";
  EXPECT_EQ(launch(x, w + 1, 16, n, k, out, nullptr), cudaErrorInvalidValue) << "w misaligned";
  EXPECT_EQ(launch(x, w, 16, n, k, nullptr, nullptr), cudaErrorInvalidValue) << "no output";
  EXPECT_EQ(launch(x, w, 16, n, k, out, reinterpret_cast<uint16_t*>(out)), cudaErrorInvalidValue) << "two outputs";
  EXPECT_EQ(launch(x, w, 16, 0, k, out, nullptr), cudaSuccess) << "n = 0: nothing to do";
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace fulcrum::test
