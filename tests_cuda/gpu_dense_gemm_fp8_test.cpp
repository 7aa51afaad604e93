// DenseGemm::run_fp8 (src/gpu/dense_gemm.hpp): bf16 x [m, k] @ FP8 W [n, k]^T, W = e4m3 codes x 128x128 block
// scales [k / 128][n / 128] (the layout DeviceWeights keeps an FP8 checkpoint's projections in), against CPU
// references on fresh random inputs: x bf16 uniform in [-1, 1), codes over the whole finite e4m3 range, scales
// log-uniform in [2^-12, 2^-8) (a scale read from the wrong block is off by up to 16x). Shapes: Qwen3-30B-A3B's
// QKV (5120 x 2048) and O (2048 x 4096) at m = 1, 8, 9, and 1024 x 2048, 256 x 384 at m = 1, 8, 9, 300; fp32 and
// bf16 output. m <= 8 takes the FP8 skinny GEMM, m > 8 the quantized path (1x128 e4m3 activations, the CUTLASS
// FP8 grouped GEMM with one group, bf16 out, widened to fp32). Outputs are poisoned (all bits set) before each
// run with a guard past m x n that must stay poisoned. Also: the skinny path over more than 8 rows (one launch per
// 8 rows, set_fp8_skinny_max_rows) within the skinny bound and bitwise per launch; one capture replays to the eager
// bits, shapes off the 128 grid and calls beyond the scratch are refused with one line. PrintsTimings times both
// paths beside the bf16 engine's GEMM (no assertion on time).
//
// References: `exact` = the dequantized weights times the bf16 x, summed in double (what a bf16 engine with
// these weights computes, before its own roundings); `quantized` = gpu::reference::quantize_rows_fp8 (bitwise
// the GPU's quantization) then gpu::reference::fp8_grouped_gemm (double sums of the quantized operands).
//
// Tolerances and why (S = sum_c |x_c W_jc| of the exact reference, Sq the quantized reference's abs sums):
//   m <= 8, fp32:  |gpu - exact| <= 4e-6 S: the FP8 skinny GEMM's accumulation bound (derived in
//                  gpu_skinny_gemm_fp8_test.cpp: at most 31 fp32 roundings on any product's path).
//   m <= 8, bf16:  exactly bf16(the fp32 output) (same kernel), and within the fp32 bound + 2^-8 |exact|.
//   m > 8, bf16:   against `quantized`, the FP8 grouped GEMM bound |gpu - ref| <= 2^-8 |ref| + 2^-10 Sq and relative
//                  L2 <= 2^-8 (derived in gpu_fp8_grouped_gemm_test.cpp: bf16 output rounding and the tensor
//                  cores' per-block accumulation).
//   m > 8, fp32:   bitwise the bf16 output widened (the widening is exact, the GEMM deterministic).
//   m > 8 vs exact: the quantization of x adds, per element c, |x~ - x| <= 2^-4 |x| (e4m3 round to nearest with
//                  3 mantissa bits, normal range) or <= 2^-10 amax / 448 (subnormal codes, step 2^-9 of the
//                  block scale amax / 448; amax <= 1 here), plus fp32 roundings of the scaling (2^-23). So
//                  |gpu - exact| <= 2^-8 |exact| + 0x1.02p-4 S + 2^-10 Sq + 1.01 * 2^-10 / 448 * sum_c |W_jc|
//                  (the grouped-GEMM bound on top, its 2^-8 |ref| taken of |exact| + the quantization error).
//                  The relative L2 error is that of the rounding alone: e4m3's relative rounding error has an
//                  RMS of about 2^-4 / sqrt(3) * E[1/m^2]^(1/2) ~ 0.026 (m the significand in [1, 2)) and the
//                  errors of a row's k products are independent, so ||gpu - exact|| / ||exact|| ~ 0.026; bound
//                  2^-4 (a factor 2.4 of room; a misplaced scale or row gives O(1)).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "eplb/error.hpp"
#include "fp8_test_util.hpp"
#include "gpu/dense_gemm.hpp"
#include "gpu/kernels/skinny_gemm.hpp"  // kSkinnyGemmMaxRows
#include "gpu/reference/fp8_reference.hpp"
#include "skinny_test_util.hpp"  // median_us

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;

constexpr double kSkinnyRelTolerance = 4e-6;  // of S; see the file comment
constexpr double kQuantizedRelL2 = 0x1p-4;
constexpr int kGuard = 64;  // poisoned elements after the m x n output
constexpr int64_t kMaxRows = 300;
constexpr int64_t kMaxK = 4096;
constexpr int64_t kMaxN = 5120;

// An FP8 weight on the host and the device, its pointers also in device memory (as DeviceWeights holds them).
struct Fp8DenseWeight {
  int n = 0, k = 0;
  std::vector<uint8_t> codes;  // [n, k]
  std::vector<float> scales;   // [ceil(k / 128)][ceil(n / 128)]
  DeviceBuffer d_codes, d_scales, d_codes_ptr, d_scales_ptr;
  int nb() const { return (n + kFp8Block - 1) / kFp8Block; }
  double value(int j, int c) const {
    return double(model::f8e4m3_to_f32(codes[static_cast<size_t>(j) * k + c])) * scales[static_cast<size_t>(c / kFp8Block) * nb() + j / kFp8Block];
  }
  gpu::Fp8Weight view() const {
    gpu::Fp8Weight v;
    v.codes = d_codes.as<uint8_t>();
    v.scales = d_scales.as<float>();
    v.device_codes_ptr = d_codes_ptr.as<const uint8_t*>();
    v.device_scales_ptr = d_scales_ptr.as<const float*>();
    return v;
  }
};

Fp8DenseWeight make_weight(int n, int k, uint64_t seed) {
  Fp8DenseWeight w;
  w.n = n;
  w.k = k;
  w.codes = random_e4m3(int64_t{n} * k, seed);
  w.scales = random_scales(int64_t{(k + kFp8Block - 1) / kFp8Block} * w.nb(), seed + 1, -12, -8);
  w.d_codes = to_device(w.codes);
  w.d_scales = to_device(w.scales);
  w.d_codes_ptr = to_device(std::vector<const uint8_t*>{w.d_codes.as<uint8_t>()});
  w.d_scales_ptr = to_device(std::vector<const float*>{w.d_scales.as<float>()});
  return w;
}

std::vector<uint16_t> random_x(int64_t n, uint64_t seed) {
  eplb::SplitMix64 rng(seed);
  std::vector<uint16_t> bits(static_cast<size_t>(n));
  for (uint16_t& b : bits) b = model::f32_to_bf16_bits(static_cast<float>(2.0 * rng.uniform() - 1.0));
  return bits;
}

// The dequantized GEMM in double: out, S = sum |x W| ([m, n]) and sum_c |W_jc| ([n]).
struct ExactReference {
  std::vector<double> out, abs_sum, w_abs;
};

ExactReference exact_reference(const std::vector<uint16_t>& x, int m, const Fp8DenseWeight& w) {
  const int n = w.n, k = w.k;
  std::vector<double> wd(static_cast<size_t>(n) * k), xd(static_cast<size_t>(m) * k);
  for (int j = 0; j < n; ++j) {
    for (int c = 0; c < k; ++c) wd[static_cast<size_t>(j) * k + c] = w.value(j, c);
  }
  for (size_t q = 0; q < xd.size(); ++q) xd[q] = model::bf16_bits_to_f32(x[q]);
  ExactReference r;
  r.out.resize(static_cast<size_t>(m) * n);
  r.abs_sum.resize(r.out.size());
  r.w_abs.assign(static_cast<size_t>(n), 0.0);
  for (int j = 0; j < n; ++j) {
    for (int c = 0; c < k; ++c) r.w_abs[j] += std::abs(wd[static_cast<size_t>(j) * k + c]);
  }
  for (int i = 0; i < m; ++i) {
    const double* xr = xd.data() + static_cast<size_t>(i) * k;
    for (int j = 0; j < n; ++j) {
      const double* wr = wd.data() + static_cast<size_t>(j) * k;
      double sum = 0, abs = 0;
      for (int c = 0; c < k; ++c) {
        sum += xr[c] * wr[c];
        abs += std::abs(xr[c] * wr[c]);
      }
      r.out[static_cast<size_t>(i) * n + j] = sum;
      r.abs_sum[static_cast<size_t>(i) * n + j] = abs;
    }
  }
  return r;
}

// The quantized path on the CPU for the first m rows of x (one group {0, m}): d and its abs sums [m, n].
struct QuantizedReference {
  std::vector<float> d, abs_sum;
};

QuantizedReference quantized_reference(const std::vector<uint16_t>& x, int m, const Fp8DenseWeight& w) {
  const std::vector<int32_t> offsets = {0, m};
  std::vector<uint8_t> q(static_cast<size_t>(m) * w.k);
  std::vector<float> sa(static_cast<size_t>(m) * (w.k / kFp8Block));
  gpu::reference::quantize_rows_fp8(std::span(x).first(static_cast<size_t>(m) * w.k), w.k, offsets, q, sa);
  QuantizedReference r;
  r.d.assign(static_cast<size_t>(m) * w.n, NAN);
  r.abs_sum.assign(r.d.size(), 0.0f);
  gpu::reference::fp8_grouped_gemm(q, sa, offsets, w.codes, w.scales, 1, w.n, w.k, r.d, r.abs_sum);
  return r;
}

class DenseGemmFp8Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the FP8 dense GEMM tests need a GPU";
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
    if (prop.major != 9 || prop.minor != 0) GTEST_SKIP() << "the CUTLASS FP8 kernels are built for sm_90a only";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    gemm_ = std::make_unique<gpu::DenseGemm>(stream_, 0, gpu::DenseFp8Capacity{kMaxRows, kMaxK, kMaxN});
    EXPECT_GT(gemm_->fp8_scratch_bytes(), kMaxRows * (kMaxK + 2 * kMaxN));
  }
  void TearDown() override {
    gemm_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Poisons out [m * n + guard], runs, returns all of it (the guard included).
  template <typename T>
  std::vector<T> run(const DeviceBuffer& x, const Fp8DenseWeight& w, int m) {
    const int64_t count = int64_t{m} * w.n + kGuard;
    DeviceBuffer out(sizeof(T) * count);
    EXPECT_EQ(cudaMemsetAsync(out.as<void>(), 0xff, out.bytes(), stream_), cudaSuccess);
    gemm_->run_fp8(x.as<uint16_t>(), w.view(), m, w.n, w.k, out.as<void>(),
                   sizeof(T) == 4 ? gpu::GemmOut::kF32 : gpu::GemmOut::kBf16);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return to_host(out.as<T>(), count);
  }

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<gpu::DenseGemm> gemm_;
};

template <typename T>
int64_t guard_lost(const std::vector<T>& out) {
  int64_t lost = 0;
  for (size_t q = out.size() - kGuard; q < out.size(); ++q) {
    T poison;
    std::memset(&poison, 0xff, sizeof(T));
    lost += std::memcmp(&out[q], &poison, sizeof(T)) != 0;
  }
  return lost;
}

uint32_t f32_bits(float v) {
  uint32_t b = 0;
  std::memcpy(&b, &v, 4);
  return b;
}

TEST_F(DenseGemmFp8Test, MatchesReferencesOnBothPaths) {
  struct Shape {
    int n, k;
    const char* name;
    std::vector<int> ms;
  };
  const Shape shapes[] = {{5120, 2048, "qkv 30B-A3B", {1, 8, 9}},
                          {2048, 4096, "o_proj 30B-A3B", {1, 8, 9}},
                          {1024, 2048, "1024 x 2048", {1, 8, 9, 300}},
                          {256, 384, "256 x 384", {1, 8, 9, 300}}};
  for (const Shape& s : shapes) {
    const int max_m = *std::max_element(s.ms.begin(), s.ms.end());
    const Fp8DenseWeight w = make_weight(s.n, s.k, 1000 + s.n + s.k);
    const std::vector<uint16_t> x = random_x(int64_t{max_m} * s.k, 2000 + s.n + s.k);
    const DeviceBuffer d_x = to_device(x);
    const ExactReference exact = exact_reference(x, max_m, w);  // row i does not depend on m
    for (const int m : s.ms) {
      SCOPED_TRACE(fmt::format("{} (n {} k {}), m {}", s.name, s.n, s.k, m));
      const size_t count = static_cast<size_t>(m) * s.n;
      const std::vector<float> f32 = run<float>(d_x, w, m);
      const std::vector<uint16_t> bf16 = run<uint16_t>(d_x, w, m);
      EXPECT_EQ(guard_lost(f32), 0) << "fp32 output written past m x n";
      EXPECT_EQ(guard_lost(bf16), 0) << "bf16 output written past m x n";
      int64_t bad = 0, not_rounding = 0;
      double err2 = 0, ref2 = 0;
      if (m <= gpu::kSkinnyGemmMaxRows) {
        for (size_t q = 0; q < count; ++q) {
          const double bound = kSkinnyRelTolerance * exact.abs_sum[q];
          bad += !(std::abs(f32[q] - exact.out[q]) <= bound);
          bad += !(std::abs(model::bf16_bits_to_f32(bf16[q]) - exact.out[q]) <= bound + std::ldexp(std::abs(exact.out[q]), -8));
          not_rounding += bf16[q] != model::f32_to_bf16_bits(f32[q]);
        }
        EXPECT_EQ(bad, 0) << "elements outside the skinny bound";
        EXPECT_EQ(not_rounding, 0) << "bf16 outputs that are not the rounded fp32 ones";
        continue;
      }
      const QuantizedReference quantized = quantized_reference(x, m, w);
      const std::vector<uint16_t> bf16_rows(bf16.begin(), bf16.begin() + static_cast<int64_t>(count));
      const auto grouped = fp8_gemm_matches(bf16_rows, quantized.d, quantized.abs_sum);
      EXPECT_TRUE(grouped) << "bf16 output vs the quantized reference";
      int64_t not_widened = 0;
      for (size_t q = 0; q < count; ++q) {
        not_widened += f32_bits(f32[q]) != f32_bits(model::bf16_bits_to_f32(bf16[q]));
        const double bound = std::ldexp(std::abs(exact.out[q]), -8) + 0x1.02p-4 * exact.abs_sum[q] +
                             std::ldexp(double(quantized.abs_sum[q]), -10) +
                             1.01 * std::ldexp(1.0, -10) / 448.0 * exact.w_abs[q % s.n];
        const double err = std::abs(double(f32[q]) - exact.out[q]);
        bad += !(err <= bound);
        err2 += std::isfinite(err) ? err * err : INFINITY;
        ref2 += exact.out[q] * exact.out[q];
      }
      const double rel_l2 = std::sqrt(err2 / std::max(ref2, 1e-300));
      EXPECT_EQ(not_widened, 0) << "fp32 outputs that are not the bf16 ones widened";
      EXPECT_EQ(bad, 0) << "elements outside the quantization bound against the exact GEMM";
      EXPECT_LE(rel_l2, kQuantizedRelL2) << "relative L2 against the exact GEMM";
      fmt::print("  FP8 dense GEMM {} m {}: {}; vs exact: relative L2 {:.4f}\n", s.name, m, grouped.message(), rel_l2);
    }
  }
}

// set_skinny(false): one row through the quantized path (a one-row group) matches the quantized reference.
TEST_F(DenseGemmFp8Test, SkinnyOffRunsOneRowQuantized) {
  const Fp8DenseWeight w = make_weight(512, 256, 77);
  const std::vector<uint16_t> x = random_x(256, 78);
  const DeviceBuffer d_x = to_device(x);
  gemm_->set_skinny(false);
  const std::vector<uint16_t> out = run<uint16_t>(d_x, w, 1);
  EXPECT_EQ(guard_lost(out), 0);
  const QuantizedReference quantized = quantized_reference(x, 1, w);
  EXPECT_TRUE(fp8_gemm_matches(std::vector<uint16_t>(out.begin(), out.begin() + 512), quantized.d, quantized.abs_sum));
}

// The quantized path captured once (global mode: an allocation or host sync inside would fail the capture)
// replays to the eager bits, at m = 9 and 300.
TEST_F(DenseGemmFp8Test, CapturedQuantizedPathReplaysToEagerBits) {
  const Fp8DenseWeight w = make_weight(1024, 2048, 91);
  const std::vector<uint16_t> x = random_x(kMaxRows * 2048, 92);
  const DeviceBuffer d_x = to_device(x);
  for (const int m : {9, 300}) {
    SCOPED_TRACE(fmt::format("m {}", m));
    const std::vector<float> eager = run<float>(d_x, w, m);
    DeviceBuffer out(sizeof(float) * (int64_t{m} * w.n + kGuard));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
    gemm_->run_fp8(d_x.as<uint16_t>(), w.view(), m, w.n, w.k, out.as<void>(), gpu::GemmOut::kF32);
    ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int replay = 0; replay < 2; ++replay) {
      ASSERT_EQ(cudaMemsetAsync(out.as<void>(), 0xff, out.bytes(), stream_), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      const std::vector<float> replayed = to_host(out.as<float>(), int64_t{m} * w.n + kGuard);
      ASSERT_EQ(replayed.size(), eager.size());
      EXPECT_EQ(std::memcmp(replayed.data(), eager.data(), 4 * eager.size()), 0) << "replay " << replay;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// set_fp8_skinny_max_rows(64): m = 20 runs the skinny GEMM in launches of 8, 8 and 4 rows. Every row within the
// skinny bound, and each launch's rows bitwise those of a call with just those rows.
TEST_F(DenseGemmFp8Test, SkinnyPathOverMoreThanEightRowsLaunchesPerEightRows) {
  const Fp8DenseWeight w = make_weight(5120, 2048, 41);
  constexpr int kRows = 20;
  const std::vector<uint16_t> x = random_x(int64_t{kRows} * w.k, 42);
  const DeviceBuffer d_x = to_device(x);
  gemm_->set_fp8_skinny_max_rows(64);
  const std::vector<float> out = run<float>(d_x, w, kRows);
  EXPECT_EQ(guard_lost(out), 0);
  const ExactReference exact = exact_reference(x, kRows, w);
  int64_t bad = 0;
  for (size_t q = 0; q < static_cast<size_t>(kRows) * w.n; ++q) {
    bad += !(std::abs(out[q] - exact.out[q]) <= kSkinnyRelTolerance * exact.abs_sum[q]);
  }
  EXPECT_EQ(bad, 0) << "elements outside the skinny bound";
  for (const auto& [first, rows] : {std::pair{0, 8}, std::pair{8, 8}, std::pair{16, 4}}) {
    const DeviceBuffer part = to_device(std::vector<uint16_t>(x.begin() + int64_t{first} * w.k,
                                                             x.begin() + int64_t{first + rows} * w.k));
    const std::vector<float> alone = run<float>(part, w, rows);
    EXPECT_EQ(std::memcmp(alone.data(), out.data() + static_cast<size_t>(first) * w.n, sizeof(float) * rows * w.n), 0)
        << "rows " << first << ".." << first + rows;
  }
}

// run_fp8's skinny path (launches of 8 rows) and quantized path at the attention projections of both presets,
// beside the bf16 engine's GEMM on a bf16 weight of the same shape (DenseGemm::run: skinny up to 8 rows, cuBLAS
// beyond), fp32 out as the engine asks. Each launch reads another copy of the weight (copies >= 5x the L2), as a
// step reads every layer's own. What kDefaultFp8SkinnyMaxRows is chosen from.
TEST_F(DenseGemmFp8Test, PrintsTimings) {
  constexpr size_t kPoolBytes = size_t{256} << 20;
  struct Shape {
    int n, k;
    const char* name;
  };
  const Shape shapes[] = {{5120, 2048, "30B qkv"}, {2048, 4096, "30B o"}, {9216, 4096, "235B qkv"}, {4096, 8192, "235B o"}};
  constexpr int kTimedMaxRows = 256;
  gpu::DenseGemm gemm(stream_, 0, gpu::DenseFp8Capacity{kTimedMaxRows, 8192, 9216});
  const DeviceBuffer x = to_device(random_x(int64_t{kTimedMaxRows} * 8192, 5));
  DeviceBuffer out(sizeof(float) * kTimedMaxRows * 9216);
  std::printf("%-9s %5s %5s %4s %12s %12s %10s\n", "shape", "n", "k", "m", "fp8 skinny", "fp8 cutlass", "bf16");
  for (const Shape& s : shapes) {
    const size_t fp8_bytes = size_t{static_cast<size_t>(s.n)} * s.k, bf16_bytes = 2 * fp8_bytes;
    const int copies = static_cast<int>(std::max<size_t>(2, kPoolBytes / fp8_bytes));
    DeviceBuffer codes(fp8_bytes * copies), bf16(bf16_bytes * std::max(2, copies / 2));
    const int bf16_copies = std::max(2, copies / 2);
    ASSERT_EQ(cudaMemset(codes.as<uint8_t>(), 0x38, codes.bytes()), cudaSuccess);  // e4m3 1.0
    ASSERT_EQ(cudaMemset(bf16.as<uint8_t>(), 0x3c, bf16.bytes()), cudaSuccess);
    const DeviceBuffer scales = to_device(random_scales(int64_t{s.k / kFp8Block} * (s.n / kFp8Block), 6, -12, -8));
    std::vector<const uint8_t*> code_ptrs(static_cast<size_t>(copies));
    for (int c = 0; c < copies; ++c) code_ptrs[c] = codes.as<uint8_t>() + c * fp8_bytes;
    const DeviceBuffer d_code_ptrs = to_device(code_ptrs);
    const DeviceBuffer d_scale_ptrs = to_device(std::vector<const float*>{scales.as<float>()});
    const auto weight = [&](int copy) {
      gpu::Fp8Weight v;
      v.codes = code_ptrs[copy];
      v.scales = scales.as<float>();
      v.device_codes_ptr = d_code_ptrs.as<const uint8_t*>() + copy;
      v.device_scales_ptr = d_scale_ptrs.as<const float*>();
      return v;
    };
    for (const int m : {8, 9, 12, 16, 24, 32, 48, 64, 96, 128, 256}) {
      gemm.set_fp8_skinny_max_rows(kTimedMaxRows);
      const double skinny_us = skinny_test::median_us(stream_, copies, [&](int copy) {
        gemm.run_fp8(x.as<uint16_t>(), weight(copy), m, s.n, s.k, out.as<void>(), gpu::GemmOut::kF32);
      });
      gemm.set_fp8_skinny_max_rows(0);
      const double cutlass_us = skinny_test::median_us(stream_, copies, [&](int copy) {
        gemm.run_fp8(x.as<uint16_t>(), weight(copy), m, s.n, s.k, out.as<void>(), gpu::GemmOut::kF32);
      });
      const double bf16_us = skinny_test::median_us(stream_, bf16_copies, [&](int copy) {
        gemm.run(x.as<uint16_t>(), bf16.as<uint16_t>() + copy * fp8_bytes, m, s.n, s.k, out.as<void>(), gpu::GemmOut::kF32);
      });
      std::printf("%-9s %5d %5d %4d %9.2f us %9.2f us %7.2f us\n", s.name, s.n, s.k, m, skinny_us, cutlass_us, bf16_us);
    }
  }
  gemm.set_fp8_skinny_max_rows(gpu::DenseGemm::kDefaultFp8SkinnyMaxRows);
}

// Refused with one line: N off the 128 grid beyond the skinny rows (the skinny path takes partial blocks), more
// rows or a wider K than the scratch, and the quantized path of a DenseGemm built without an FP8 capacity.
TEST_F(DenseGemmFp8Test, RefusesShapesOffTheGridAndBeyondTheScratch) {
  const auto refused = [&](gpu::DenseGemm& gemm, const DeviceBuffer& x, const Fp8DenseWeight& w, int64_t m, const char* what) {
    DeviceBuffer out(sizeof(float) * m * w.n);
    try {
      gemm.run_fp8(x.as<uint16_t>(), w.view(), m, w.n, w.k, out.as<void>(), gpu::GemmOut::kF32);
      ADD_FAILURE() << what << ": not refused";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
  };
  const Fp8DenseWeight partial = make_weight(200, 256, 5);  // n = 200: half a scale block at the end
  const std::vector<uint16_t> x = random_x((kMaxRows + 1) * int64_t{kMaxK + 128}, 6);
  const DeviceBuffer d_x = to_device(x);
  // One row: the skinny GEMM takes the partial block, within its bound.
  const std::vector<float> one = run<float>(d_x, partial, 1);
  const ExactReference exact = exact_reference(x, 1, partial);
  int64_t bad = 0;
  for (int j = 0; j < partial.n; ++j) bad += !(std::abs(one[j] - exact.out[j]) <= kSkinnyRelTolerance * exact.abs_sum[j]);
  EXPECT_EQ(bad, 0);
  refused(*gemm_, d_x, partial, 9, "n 200 at 9 rows");
  const Fp8DenseWeight square = make_weight(256, 256, 7);
  refused(*gemm_, d_x, square, kMaxRows + 1, "more rows than the scratch");
  const Fp8DenseWeight wide = make_weight(256, static_cast<int>(kMaxK + 128), 8);
  refused(*gemm_, d_x, wide, 9, "K wider than the scratch");
  gpu::DenseGemm bare(stream_, 0);
  EXPECT_EQ(bare.fp8_scratch_bytes(), 0);
  refused(bare, d_x, square, 9, "no FP8 capacity");
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

}  // namespace
}  // namespace fulcrum::test
