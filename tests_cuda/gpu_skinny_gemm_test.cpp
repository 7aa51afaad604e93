// The skinny GEMM (src/gpu/kernels/skinny_gemm.cu) against its CPU reference (src/gpu/reference/
// skinny_gemm_reference.hpp) on fresh random bf16 inputs in [-1, 1): Qwen3-30B-A3B's decode shapes (QKV 5120 x
// 2048, O 2048 x 4096, router 128 x 2048, LM head 151936 x 2048, 1536 x 2048), tiny-model shapes (64 x 64,
// 512 x 256) and odd ones (n not a multiple of 4, k not a multiple of 256, uneven K slices, n = 1), m = 1..8, fp32 and bf16 output.
// Outputs are poisoned (all bits set: NaN in fp32 and bf16) before each run, with a guard past m x n that must stay
// poisoned. Row i must be bitwise the same for every m (batch invariance), and the bf16 output must be exactly
// the bf16 rounding of the fp32 one. Bad arguments are refused; a launch captured in a CUDA graph replays to the
// same bits; the bulk-copy and register W paths give the same bits. PrintsTimings times the kernel (its default
// path and the register path) beside cuBLAS (DenseGemm) at m = 1, 4, 8: no assertion on time.
//
// Tolerances and why:
//   fp32  |gpu - ref| <= 1e-5 * sum_k |x_k w_k|. The reference is the correctly rounded sum (double). The kernel
//         adds, per lane, its k / (32 * k_split) products in one fp32 FMA chain, then 5 butterfly adds and up to
//         3 slice adds: at most k / 32 + 8 roundings on the path of any product, so its error is at most
//         (k / 32 + 8) * 2^-24 * sum |x w| (plus 2^-24 |ref| for the reference's own rounding): 8.2e-6 at the
//         largest k tested (4096), under 1e-5.
//   bf16  exactly bf16(fp32 output of the same kernel); against the reference within the fp32 bound above plus
//         one bf16 step at |ref| (the rounding of a value that may sit across a bf16 rounding boundary).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "gpu/dense_gemm.hpp"
#include "gpu/kernels/skinny_gemm.hpp"
#include "gpu/reference/skinny_gemm_reference.hpp"
#include "model/checkpoint_writer.hpp"
#include "skinny_test_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using namespace skinny_test;

constexpr double kRelTolerance = 1e-5;  // of sum |x w|; see the file comment
constexpr int kGuard = 64;              // poisoned elements after the m x n output
constexpr int kMaxRows = gpu::kSkinnyGemmMaxRows;

struct Shape {
  int n;
  int k;
  const char* name;
};
const Shape kShapes[] = {
    {5120, 2048, "qkv"},  {2048, 4096, "o_proj"}, {128, 2048, "router"},  {151936, 2048, "lm_head"},
    {1536, 2048, "1536"}, {64, 64, "tiny 64"},   {512, 256, "tiny 512"}, {77, 328, "odd 77 x 328"},
    {200, 1032, "odd 200 x 1032"}, {1, 8, "1 x 8"},
};
constexpr int kNumModelShapes = 5;  // the first five: timed by PrintsTimings

class SkinnyGemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the skinny GEMM tests need a GPU";
  }
};

// Runs the kernel on the first m rows of x into a poisoned output of m * n + kGuard elements; returns them.
template <typename T>
std::vector<T> run_poisoned(const uint16_t* x, const uint16_t* w, int m, int n, int k, DeviceBuffer& out) {
  const size_t count = static_cast<size_t>(m) * n + kGuard;
  EXPECT_EQ(cudaMemset(out.as<T>(), 0xff, sizeof(T) * count), cudaSuccess);
  float* out_f32 = std::is_same_v<T, float> ? reinterpret_cast<float*>(out.as<T>()) : nullptr;
  uint16_t* out_bf16 = std::is_same_v<T, uint16_t> ? reinterpret_cast<uint16_t*>(out.as<T>()) : nullptr;
  EXPECT_EQ(gpu::launch_skinny_gemm(x, w, m, n, k, out_f32, out_bf16, nullptr), cudaSuccess);
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

TEST_F(SkinnyGemmTest, MatchesReferenceAtModelShapes) {
  uint64_t seed = 1;
  for (const Shape& shape : kShapes) {
    const int n = shape.n, k = shape.k;
    SCOPED_TRACE(::testing::Message() << shape.name << ": n " << n << ", k " << k);
    const std::vector<uint16_t> x = random_bf16(static_cast<size_t>(kMaxRows) * k, seed++);  // [8, k]
    const std::vector<uint16_t> w = random_bf16(static_cast<size_t>(n) * k, seed++);         // [n, k]
    // Row i of the product does not depend on the other rows, so one reference of all 8 rows serves every m.
    std::vector<float> ref(static_cast<size_t>(kMaxRows) * n), abs_sums(ref.size());  // [8, n]
    gpu::reference::skinny_gemm(x, w, kMaxRows, n, k, ref, abs_sums);

    DeviceBuffer x_dev = upload(x), w_dev = upload(w);
    DeviceBuffer out_dev(sizeof(float) * (static_cast<size_t>(kMaxRows) * n + kGuard));
    std::vector<float> full_f32;      // m = 8, fp32: every other m must match its rows bitwise
    std::vector<uint16_t> full_bf16;  // m = 8, bf16
    for (int m = kMaxRows; m >= 1; --m) {
      SCOPED_TRACE(::testing::Message() << "m " << m);
      const size_t count = static_cast<size_t>(m) * n;
      const std::vector<float> f32 = run_poisoned<float>(x_dev.as<uint16_t>(), w_dev.as<uint16_t>(), m, n, k, out_dev);
      const std::vector<uint16_t> bf16 =
          run_poisoned<uint16_t>(x_dev.as<uint16_t>(), w_dev.as<uint16_t>(), m, n, k, out_dev);
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

// The bulk-copy path (W tiles into shared memory) and the register path compute the same tiles, K slices and
// sums in the same order: the same bits for every shape and m, fp32 and bf16 (tiles above 96 KB, the LM head
// shape's at m = 1, stay on the register path even with kBulk, so there the check is of the path against itself).
TEST_F(SkinnyGemmTest, BulkLoadsGiveTheRegisterPathsBits) {
  uint64_t seed = 101;
  for (const Shape& shape : kShapes) {
    const int n = shape.n, k = shape.k;
    SCOPED_TRACE(::testing::Message() << shape.name << ": n " << n << ", k " << k);
    DeviceBuffer x_dev = upload(random_bf16(static_cast<size_t>(kMaxRows) * k, seed++));
    DeviceBuffer w_dev = upload(random_bf16(static_cast<size_t>(n) * k, seed++));
    const size_t most = static_cast<size_t>(kMaxRows) * n + kGuard;
    DeviceBuffer out_dev(sizeof(float) * most);
    const auto run = [&](int m, bool bf16, gpu::SkinnyWeightLoads loads) {
      EXPECT_EQ(cudaMemset(out_dev.as<float>(), 0xff, sizeof(float) * most), cudaSuccess);
      float* f32 = bf16 ? nullptr : out_dev.as<float>();
      uint16_t* b16 = bf16 ? reinterpret_cast<uint16_t*>(out_dev.as<float>()) : nullptr;
      EXPECT_EQ(gpu::launch_skinny_gemm(x_dev.as<uint16_t>(), w_dev.as<uint16_t>(), m, n, k, f32, b16, nullptr, loads),
                cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      return download(out_dev.as<float>(), most);  // bf16 outputs compared as raw words, guard included
    };
    for (int m = 1; m <= kMaxRows; ++m) {
      for (const bool bf16 : {false, true}) {
        const std::vector<float> bulk = run(m, bf16, gpu::SkinnyWeightLoads::kBulk);
        const std::vector<float> regs = run(m, bf16, gpu::SkinnyWeightLoads::kRegisters);
        EXPECT_EQ(std::memcmp(bulk.data(), regs.data(), sizeof(float) * most), 0)
            << "m " << m << (bf16 ? " bf16" : " fp32") << ": the two paths differ";
      }
    }
  }
}

TEST_F(SkinnyGemmTest, RefusesBadArguments) {
  const int n = 64, k = 64;
  DeviceBuffer x_dev = upload(random_bf16(static_cast<size_t>(kMaxRows) * k + 8, 11));
  DeviceBuffer w_dev = upload(random_bf16(static_cast<size_t>(n) * k + 8, 12));
  DeviceBuffer out_dev(sizeof(float) * (static_cast<size_t>(kMaxRows) * n + 8));
  const uint16_t* x = x_dev.as<uint16_t>();
  const uint16_t* w = w_dev.as<uint16_t>();
  float* out = out_dev.as<float>();
  const auto launch = [&](const uint16_t* xp, const uint16_t* wp, int m, int nn, int kk, float* of, uint16_t* ob) {
    return gpu::launch_skinny_gemm(xp, wp, m, nn, kk, of, ob, nullptr);
  };
  EXPECT_EQ(launch(x, w, 0, n, k, out, nullptr), cudaErrorInvalidValue) << "m = 0";
  EXPECT_EQ(launch(x, w, 9, n, k, out, nullptr), cudaErrorInvalidValue) << "m = 9";
  EXPECT_EQ(launch(x, w, 1, -1, k, out, nullptr), cudaErrorInvalidValue) << "n < 0";
  EXPECT_EQ(launch(x, w, 1, n, 0, out, nullptr), cudaErrorInvalidValue) << "k = 0";
  EXPECT_EQ(launch(x, w, 1, n, 60, out, nullptr), cudaErrorInvalidValue) << "k % 8 != 0";
  EXPECT_EQ(launch(x + 1, w, 1, n, k, out, nullptr), cudaErrorInvalidValue) << "x misaligned";
  EXPECT_EQ(launch(x + 4, w, 1, n, k, out, nullptr), cudaErrorInvalidValue) << "x 8 bytes off";
  EXPECT_EQ(launch(x, w + 1, 1, n, k, out, nullptr), cudaErrorInvalidValue) << "w misaligned";
  EXPECT_EQ(launch(x, w, 1, n, k, nullptr, nullptr), cudaErrorInvalidValue) << "no output";
  EXPECT_EQ(launch(x, w, 1, n, k, out, reinterpret_cast<uint16_t*>(out)), cudaErrorInvalidValue) << "two outputs";
  EXPECT_EQ(launch(x, w, 1, n, k, reinterpret_cast<float*>(reinterpret_cast<char*>(out) + 2), nullptr),
            cudaErrorInvalidValue)
      << "fp32 output misaligned";
  EXPECT_EQ(launch(x, w, 1, n, k, nullptr, reinterpret_cast<uint16_t*>(reinterpret_cast<char*>(out) + 1)),
            cudaErrorInvalidValue)
      << "bf16 output misaligned";
  EXPECT_EQ(launch(x, w, 1, 0, k, out, nullptr), cudaSuccess) << "n = 0: nothing to do";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  // The 16-byte-aligned offset of x and w is accepted.
  EXPECT_EQ(launch(x + 8, w + 8, 1, n, k - 8, out, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST_F(SkinnyGemmTest, CapturedGraphReplaysSameBits) {
  const int m = 3, n = 1536, k = 2048;
  DeviceBuffer x_dev = upload(random_bf16(static_cast<size_t>(m) * k, 21));
  DeviceBuffer w_dev = upload(random_bf16(static_cast<size_t>(n) * k, 22));
  DeviceBuffer direct_dev(sizeof(float) * m * n), graph_dev(sizeof(float) * m * n);
  ASSERT_EQ(gpu::launch_skinny_gemm(x_dev.as<uint16_t>(), w_dev.as<uint16_t>(), m, n, k, direct_dev.as<float>(),
                                    nullptr, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(gpu::launch_skinny_gemm(x_dev.as<uint16_t>(), w_dev.as<uint16_t>(), m, n, k, graph_dev.as<float>(),
                                    nullptr, stream),
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

TEST_F(SkinnyGemmTest, PrintsTimings) {
  constexpr double kHbmBytesPerSecond = 4.2e12;  // H200 HBM3e, the roofline the fractions are of
  constexpr size_t kPoolBytes = size_t{256} << 20;  // weight copies totalling >= 5x the 50 MB L2
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    gpu::DenseGemm cublas(stream, 0);
    cublas.set_skinny(false);  // cuBLAS for every m: the comparison
    std::printf("%-8s %6s %5s %2s %10s %10s %10s %9s %9s\n", "shape", "n", "k", "m", "skinny us", "regs us",
                "cublas us", "skinny %", "cublas %");
    for (int shape_idx = 0; shape_idx < kNumModelShapes; ++shape_idx) {
      const Shape& shape = kShapes[shape_idx];
      const int n = shape.n, k = shape.k;
      const size_t w_bytes = sizeof(uint16_t) * n * static_cast<size_t>(k);
      const int copies = static_cast<int>(std::max<size_t>(1, (kPoolBytes + w_bytes - 1) / w_bytes));
      DeviceBuffer w_pool(w_bytes * copies);
      ASSERT_EQ(cudaMemset(w_pool.as<uint16_t>(), 0x3c, w_bytes * copies), cudaSuccess);  // bf16 0x3c3c ~ 0.011
      DeviceBuffer x_dev = upload(random_bf16(static_cast<size_t>(kMaxRows) * k, 31));
      DeviceBuffer out_dev(sizeof(float) * kMaxRows * static_cast<size_t>(n));
      const auto w_copy = [&](int copy) { return w_pool.as<uint16_t>() + static_cast<size_t>(copy) * n * k; };
      for (const int m : {1, 4, 8}) {
        const double skinny = median_us(stream, copies, [&](int copy) {
          EXPECT_EQ(gpu::launch_skinny_gemm(x_dev.as<uint16_t>(), w_copy(copy), m, n, k, out_dev.as<float>(), nullptr,
                                            stream),
                    cudaSuccess);
        });
        const double regs = median_us(stream, copies, [&](int copy) {
          EXPECT_EQ(gpu::launch_skinny_gemm(x_dev.as<uint16_t>(), w_copy(copy), m, n, k, out_dev.as<float>(), nullptr,
                                            stream, gpu::SkinnyWeightLoads::kRegisters),
                    cudaSuccess);
        });
        const double cublas_us = median_us(stream, copies, [&](int copy) {
          cublas.run(x_dev.as<uint16_t>(), w_copy(copy), m, n, k, out_dev.as<float>(), gpu::GemmOut::kF32);
        });
        const double roofline_us = 1e6 * static_cast<double>(w_bytes) / kHbmBytesPerSecond;
        std::printf("%-8s %6d %5d %2d %10.2f %10.2f %10.2f %8.0f%% %8.0f%%\n", shape.name, n, k, m, skinny, regs,
                    cublas_us, 100 * roofline_us / skinny, 100 * roofline_us / cublas_us);
      }
    }
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace fulcrum::test
