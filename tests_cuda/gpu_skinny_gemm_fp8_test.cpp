// The skinny GEMM with FP8 weights (gpu::launch_skinny_gemm_fp8: w e4m3 [n, k], w_scales fp32
// [ceil(k / 128)][ceil(n / 128)]) against its CPU reference (reference::skinny_gemm_fp8) on fresh random inputs:
// x bf16 in [-1, 1), every non-NaN e4m3 byte equally likely (zeros, subnormals, up to +-448), scales in
// [0.5, 1.5) / 1024. Shapes: Qwen3-30B-A3B's attention projections (QKV 5120 x 2048, O 2048 x 4096), 1536 x 2048,
// small ones and partial scale blocks (320 x 192: k ends in half a block; 77 x 336, 200 x 1040: n and k both
// partial, uneven K slices; 1 x 16), m = 1..8, fp32 and bf16 output. Outputs are poisoned (all bits set: NaN in
// fp32 and bf16) before each run, with a guard past m x n that must stay poisoned. Row i must be bitwise the same
// for every m (batch invariance), the bf16 output exactly the bf16 rounding of the fp32 one. Bad arguments are
// refused; a captured launch replays to the same bits. PrintsTimings times it beside the bf16 skinny GEMM at
// m = 1, 4, 8: no assertion on time.
//
// Tolerances and why:
//   fp32  |gpu - ref| <= 4e-6 * sum_k |x_k W_k| (W = e4m3 value x scale). The reference is the correctly rounded
//         sum (double). In the kernel each product of an e4m3 and a bf16 value is exact in fp32 (4 + 8
//         significant bits); a lane sums a 16-weight chunk's products in an fp32 FMA chain (at most 15
//         roundings), folds the chunk sum into its accumulator with one FMA by the block scale (the scaling
//         exact inside the FMA; 1 rounding, then 1 per later chunk of the lane: at most k / 512 in all), then 5
//         butterfly and at most 3 slice additions: at most 15 + k / 512 + 8 = 31 roundings on any product's path
//         at the largest k tested (4096), so |error| <= 31 * 2^-24 * sum |x W| = 1.9e-6 * sum |x W| (first
//         order), under the bound.
//   bf16  exactly bf16(fp32 output of the same kernel); against the reference within the fp32 bound plus one
//         bf16 step at |ref| (the rounding of a value that may sit across a bf16 rounding boundary).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/kernels/skinny_gemm.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "gpu/reference/skinny_gemm_reference.hpp"
#include "skinny_test_util.hpp"
#include "model/checkpoint_writer.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using namespace skinny_test;

constexpr double kRelTolerance = 4e-6;  // of sum |x W|; see the file comment
constexpr int kGuard = 64;              // poisoned elements after the m x n output
constexpr int kMaxRows = gpu::kSkinnyGemmMaxRows;
constexpr int kBlock = 128;

struct Shape {
  int n;
  int k;
  const char* name;
  size_t scale_count() const { return static_cast<size_t>((k + kBlock - 1) / kBlock) * ((n + kBlock - 1) / kBlock); }
};
const Shape kShapes[] = {
    {5120, 2048, "qkv"},          {2048, 4096, "o_proj"},        {1536, 2048, "1536"},
    {128, 256, "tiny 128 x 256"}, {320, 192, "partial 320 x 192"}, {77, 336, "partial 77 x 336"},
    {200, 1040, "partial 200 x 1040"}, {1, 16, "1 x 16"},
};
constexpr int kNumModelShapes = 3;  // the first three: timed by PrintsTimings

class SkinnyGemmFp8Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the skinny GEMM tests need a GPU";
  }
};

// Runs the kernel on the first m rows of x into a poisoned output of m * n + kGuard elements; returns them.
template <typename T>
std::vector<T> run_poisoned(const uint16_t* x, const uint8_t* w, const float* scales, int m, int n, int k,
                            DeviceBuffer& out) {
  const size_t count = static_cast<size_t>(m) * n + kGuard;
  EXPECT_EQ(cudaMemset(out.as<T>(), 0xff, sizeof(T) * count), cudaSuccess);
  float* out_f32 = std::is_same_v<T, float> ? reinterpret_cast<float*>(out.as<T>()) : nullptr;
  uint16_t* out_bf16 = std::is_same_v<T, uint16_t> ? reinterpret_cast<uint16_t*>(out.as<T>()) : nullptr;
  EXPECT_EQ(gpu::launch_skinny_gemm_fp8(x, w, scales, m, n, k, out_f32, out_bf16, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return download(out.as<T>(), count);
}

// Counts of values outside the bound and of guard values overwritten; the first bad index.
struct Check {
  int64_t bad = 0;
  int64_t guard_written = 0;
  int64_t first_bad = -1;
  void fail(int64_t idx) {
    if (bad++ == 0) first_bad = idx;
  }
};

TEST_F(SkinnyGemmFp8Test, MatchesReferenceAtModelAndPartialShapes) {
  uint64_t seed = 1;
  for (const Shape& shape : kShapes) {
    const int n = shape.n, k = shape.k;
    SCOPED_TRACE(::testing::Message() << shape.name << ": n " << n << ", k " << k);
    const std::vector<uint16_t> x = random_bf16(static_cast<size_t>(kMaxRows) * k, seed++);  // [8, k]
    const std::vector<uint8_t> w = random_e4m3(static_cast<size_t>(n) * k, seed++);          // [n, k]
    const std::vector<float> scales = random_scales(shape.scale_count(), seed++);
    // Row i of the product does not depend on the other rows, so one reference of all 8 rows serves every m.
    std::vector<float> ref(static_cast<size_t>(kMaxRows) * n), abs_sums(ref.size());  // [8, n]
    gpu::reference::skinny_gemm_fp8(x, w, scales, kMaxRows, n, k, ref, abs_sums);

    DeviceBuffer x_dev = upload(x), w_dev = upload(w), scales_dev = upload(scales);
    DeviceBuffer out_dev(sizeof(float) * (static_cast<size_t>(kMaxRows) * n + kGuard));
    std::vector<float> full_f32;      // m = 8, fp32: every other m must match its rows bitwise
    std::vector<uint16_t> full_bf16;  // m = 8, bf16
    for (int m = kMaxRows; m >= 1; --m) {
      SCOPED_TRACE(::testing::Message() << "m " << m);
      const size_t count = static_cast<size_t>(m) * n;
      const std::vector<float> f32 =
          run_poisoned<float>(x_dev.as<uint16_t>(), w_dev.as<uint8_t>(), scales_dev.as<float>(), m, n, k, out_dev);
      const std::vector<uint16_t> bf16 =
          run_poisoned<uint16_t>(x_dev.as<uint16_t>(), w_dev.as<uint8_t>(), scales_dev.as<float>(), m, n, k, out_dev);
      if (m == kMaxRows) {
        full_f32 = f32;
        full_bf16 = bf16;
      }
      Check f32_check, bf16_check, rounding_check, invariance_check;
      for (size_t q = 0; q < count; ++q) {
        const double bound = kRelTolerance * abs_sums[q];
        if (!(std::abs(static_cast<double>(f32[q]) - ref[q]) <= bound)) f32_check.fail(q);  // NaN fails
        const float b = model::bf16_bits_to_f32(bf16[q]);
        if (!(std::abs(static_cast<double>(b) - ref[q]) <= bound + bf16_spacing_above(std::abs(ref[q])))) {
          bf16_check.fail(q);
        }
        if (bf16[q] != model::f32_to_bf16_bits(f32[q])) rounding_check.fail(q);
        if (std::memcmp(&f32[q], &full_f32[q], sizeof(float)) != 0 || bf16[q] != full_bf16[q]) {
          invariance_check.fail(q);
        }
      }
      for (size_t q = count; q < count + kGuard; ++q) {
        uint32_t f32_bits;
        std::memcpy(&f32_bits, &f32[q], sizeof(f32_bits));
        if (f32_bits != 0xffffffffu) ++f32_check.guard_written;
        if (bf16[q] != 0xffffu) ++bf16_check.guard_written;
      }
      EXPECT_EQ(f32_check.bad, 0) << "fp32 values off; first at " << f32_check.first_bad << ": "
                                  << (f32_check.bad ? f32[f32_check.first_bad] : 0.0f) << " vs "
                                  << (f32_check.bad ? ref[f32_check.first_bad] : 0.0f);
      EXPECT_EQ(bf16_check.bad, 0) << "bf16 values off; first at " << bf16_check.first_bad;
      EXPECT_EQ(rounding_check.bad, 0) << "bf16 output is not bf16(fp32 output); first at " << rounding_check.first_bad;
      EXPECT_EQ(invariance_check.bad, 0) << "rows differ from the m = 8 run; first at " << invariance_check.first_bad;
      EXPECT_EQ(f32_check.guard_written, 0) << "fp32 guard overwritten";
      EXPECT_EQ(bf16_check.guard_written, 0) << "bf16 guard overwritten";
    }
  }
}

TEST_F(SkinnyGemmFp8Test, RefusesBadArguments) {
  const int n = 64, k = 64;
  DeviceBuffer x_dev = upload(random_bf16(static_cast<size_t>(kMaxRows) * k + 16, 11));
  DeviceBuffer w_dev = upload(random_e4m3(static_cast<size_t>(n) * k + 32, 12));
  DeviceBuffer scales_dev = upload(random_scales(4, 13));
  DeviceBuffer out_dev(sizeof(float) * (static_cast<size_t>(kMaxRows) * n + 8));
  const uint16_t* x = x_dev.as<uint16_t>();
  const uint8_t* w = w_dev.as<uint8_t>();
  const float* s = scales_dev.as<float>();
  float* out = out_dev.as<float>();
  const auto launch = [&](const uint16_t* xp, const uint8_t* wp, const float* sp, int m, int nn, int kk, float* of,
                          uint16_t* ob) { return gpu::launch_skinny_gemm_fp8(xp, wp, sp, m, nn, kk, of, ob, nullptr); };
  EXPECT_EQ(launch(x, w, s, 0, n, k, out, nullptr), cudaErrorInvalidValue) << "m = 0";
  EXPECT_EQ(launch(x, w, s, 9, n, k, out, nullptr), cudaErrorInvalidValue) << "m = 9";
  EXPECT_EQ(launch(x, w, s, 1, -1, k, out, nullptr), cudaErrorInvalidValue) << "n < 0";
  EXPECT_EQ(launch(x, w, s, 1, n, 0, out, nullptr), cudaErrorInvalidValue) << "k = 0";
  EXPECT_EQ(launch(x, w, s, 1, n, 24, out, nullptr), cudaErrorInvalidValue) << "k % 16 != 0 (k % 8 == 0)";
  EXPECT_EQ(launch(x + 1, w, s, 1, n, k, out, nullptr), cudaErrorInvalidValue) << "x misaligned";
  EXPECT_EQ(launch(x, w + 8, s, 1, n, k, out, nullptr), cudaErrorInvalidValue) << "w 8 bytes off";
  EXPECT_EQ(launch(x, w, nullptr, 1, n, k, out, nullptr), cudaErrorInvalidValue) << "no scales";
  EXPECT_EQ(launch(x, w, reinterpret_cast<const float*>(reinterpret_cast<const char*>(s) + 2), 1, n, k, out, nullptr),
            cudaErrorInvalidValue)
      << "scales misaligned";
  EXPECT_EQ(launch(x, w, s, 1, n, k, nullptr, nullptr), cudaErrorInvalidValue) << "no output";
  EXPECT_EQ(launch(x, w, s, 1, n, k, out, reinterpret_cast<uint16_t*>(out)), cudaErrorInvalidValue) << "two outputs";
  EXPECT_EQ(launch(x, w, s, 1, n, k, reinterpret_cast<float*>(reinterpret_cast<char*>(out) + 2), nullptr),
            cudaErrorInvalidValue)
      << "fp32 output misaligned";
  EXPECT_EQ(launch(x, w, s, 1, 0, k, out, nullptr), cudaSuccess) << "n = 0: nothing to do";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  // 16-byte-aligned offsets of x and w are accepted (k 48: x rows 96 bytes, w rows 48 bytes apart).
  EXPECT_EQ(launch(x + 8, w + 16, s, 1, n, k - 16, out, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST_F(SkinnyGemmFp8Test, CapturedGraphReplaysSameBits) {
  const Shape shape{1536, 2048, "1536"};
  const int m = 3, n = shape.n, k = shape.k;
  DeviceBuffer x_dev = upload(random_bf16(static_cast<size_t>(m) * k, 21));
  DeviceBuffer w_dev = upload(random_e4m3(static_cast<size_t>(n) * k, 22));
  DeviceBuffer scales_dev = upload(random_scales(shape.scale_count(), 23));
  DeviceBuffer direct_dev(sizeof(float) * m * n), graph_dev(sizeof(float) * m * n);
  ASSERT_EQ(gpu::launch_skinny_gemm_fp8(x_dev.as<uint16_t>(), w_dev.as<uint8_t>(), scales_dev.as<float>(), m, n, k,
                                        direct_dev.as<float>(), nullptr, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(gpu::launch_skinny_gemm_fp8(x_dev.as<uint16_t>(), w_dev.as<uint8_t>(), scales_dev.as<float>(), m, n, k,
                                        graph_dev.as<float>(), nullptr, stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    ASSERT_EQ(cudaMemsetAsync(graph_dev.as<float>(), 0xff, sizeof(float) * m * n, stream), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<float> direct = download(direct_dev.as<float>(), static_cast<size_t>(m) * n);
    const std::vector<float> replayed = download(graph_dev.as<float>(), static_cast<size_t>(m) * n);
    EXPECT_EQ(std::memcmp(direct.data(), replayed.data(), sizeof(float) * direct.size()), 0) << "replay " << replay;
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// FP8 vs bf16 skinny GEMM at the model shapes; the fraction is of the HBM roofline of each one's weight bytes.
TEST_F(SkinnyGemmFp8Test, PrintsTimings) {
  constexpr double kHbmBytesPerSecond = 4.2e12;     // H200 HBM3e, the roofline the fractions are of
  constexpr size_t kPoolBytes = size_t{256} << 20;  // weight copies totalling >= 5x the 50 MB L2
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::printf("%-6s %5s %5s %2s %9s %9s %7s %7s\n", "shape", "n", "k", "m", "fp8 us", "bf16 us", "fp8 %", "bf16 %");
  for (int shape_idx = 0; shape_idx < kNumModelShapes; ++shape_idx) {
    const Shape& shape = kShapes[shape_idx];
    const int n = shape.n, k = shape.k;
    const size_t fp8_bytes = static_cast<size_t>(n) * k, bf16_bytes = 2 * fp8_bytes;
    const auto copies_of = [&](size_t bytes) { return static_cast<int>(std::max<size_t>(1, (kPoolBytes + bytes - 1) / bytes)); };
    const int fp8_copies = copies_of(fp8_bytes), bf16_copies = copies_of(bf16_bytes);
    DeviceBuffer fp8_pool(fp8_bytes * fp8_copies), bf16_pool(bf16_bytes * bf16_copies);
    ASSERT_EQ(cudaMemset(fp8_pool.as<uint8_t>(), 0x38, fp8_bytes * fp8_copies), cudaSuccess);      // e4m3 1.0
    ASSERT_EQ(cudaMemset(bf16_pool.as<uint16_t>(), 0x3c, bf16_bytes * bf16_copies), cudaSuccess);  // bf16 ~0.011
    DeviceBuffer scales_dev = upload(random_scales(shape.scale_count(), 30));
    DeviceBuffer x_dev = upload(random_bf16(static_cast<size_t>(kMaxRows) * k, 31));
    DeviceBuffer out_dev(sizeof(float) * kMaxRows * static_cast<size_t>(n));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (const int m : {1, 4, 8}) {
      const double fp8_us = median_us(stream, fp8_copies, [&](int copy) {
        EXPECT_EQ(gpu::launch_skinny_gemm_fp8(x_dev.as<uint16_t>(), fp8_pool.as<uint8_t>() + copy * fp8_bytes,
                                              scales_dev.as<float>(), m, n, k, out_dev.as<float>(), nullptr, stream),
                  cudaSuccess);
      });
      const double bf16_us = median_us(stream, bf16_copies, [&](int copy) {
        EXPECT_EQ(gpu::launch_skinny_gemm(x_dev.as<uint16_t>(), bf16_pool.as<uint16_t>() + copy * fp8_bytes, m, n, k,
                                          out_dev.as<float>(), nullptr, stream),
                  cudaSuccess);
      });
      std::printf("%-6s %5d %5d %2d %9.2f %9.2f %6.0f%% %6.0f%%\n", shape.name, n, k, m, fp8_us, bf16_us,
                  100 * 1e6 * static_cast<double>(fp8_bytes) / kHbmBytesPerSecond / fp8_us,
                  100 * 1e6 * static_cast<double>(bf16_bytes) / kHbmBytesPerSecond / bf16_us);
    }
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace fulcrum::test
