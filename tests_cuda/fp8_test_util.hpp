#pragma once
// Helpers of the FP8 expert path tests (gpu_fp8_grouped_gemm_test.cpp, gpu_fp8_quant_test.cpp): random e4m3
// data and scales, skewed group sizes, FP8 weights on the device, the GEMM fixture, and the comparison of a
// bf16 GEMM output with the CPU reference under the per-element bound derived in gpu_fp8_grouped_gemm_test.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <numeric>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "eplb/dispatch.hpp"  // SplitMix64
#include "gpu/cutlass/grouped_gemm_fp8.hpp"
#include "gpu/moe/moe_layer.hpp"  // DeviceBuffer
#include "model/checkpoint_writer.hpp"
#include "model/safetensors.hpp"
#include "moe_cuda_test_util.hpp"

namespace fulcrum::test {

constexpr int kFp8Block = gpu::kFp8BlockSize;

// e4m3 codes of values uniform in [-448, 448) (round to nearest even): every finite code reachable, zero
// only for |value| < 2^-10 (about one in 450000).
inline std::vector<uint8_t> random_e4m3(int64_t n, uint64_t seed) {
  eplb::SplitMix64 rng(seed);
  std::vector<uint8_t> codes(static_cast<size_t>(n));
  for (uint8_t& c : codes) c = model::f32_to_f8e4m3_bits(static_cast<float>((2.0 * rng.uniform() - 1.0) * 448.0));
  return codes;
}

// Scales log-uniform in [2^lo_exp, 2^hi_exp): blocks with very different weights, so a scale read from the
// wrong row or block changes a product by a large factor.
inline std::vector<float> random_scales(int64_t n, uint64_t seed, int lo_exp, int hi_exp) {
  eplb::SplitMix64 rng(seed);
  std::vector<float> scales(static_cast<size_t>(n));
  for (float& s : scales) s = static_cast<float>(std::exp2(lo_exp + (hi_exp - lo_exp) * rng.uniform()));
  return scales;
}

inline std::vector<int32_t> offsets_from(const std::vector<int32_t>& counts, int32_t first_row) {
  std::vector<int32_t> offsets(1, first_row);
  for (const int32_t c : counts) offsets.push_back(offsets.back() + c);
  return offsets;
}

// `groups` group sizes ~ largest / (rank + 1)^1.2, shuffled (deterministic): a group of `largest` rows
// (several 64- and 128-row tiles), a long tail of empty groups (largest >= 100), and exactly one 1-row group.
inline std::vector<int32_t> skewed_counts(int groups, int largest, uint64_t seed) {
  std::vector<int32_t> counts(static_cast<size_t>(groups));
  for (int rank = 0; rank < groups; ++rank) {
    counts[rank] = static_cast<int32_t>(largest / std::pow(rank + 1.0, 1.2));
    if (counts[rank] == 1) counts[rank] = 2;  // the only 1-row group is placed below
  }
  eplb::SplitMix64 rng(seed);
  for (int q = groups - 1; q > 0; --q) std::swap(counts[q], counts[rng.below(static_cast<uint32_t>(q + 1))]);
  *std::find(counts.begin(), counts.end(), 0) = 1;  // the first empty group (there are dozens) gets one row
  return counts;
}

// num_b FP8 weight matrices e4m3 [N, K] with fp32 scales [Kb][N / 128], on the host and the device, and the
// device pointer arrays the GEMM takes.
struct Fp8Weights {
  int n = 0, k = 0, num_b = 0;
  std::vector<uint8_t> b;         // [num_b, N, K]
  std::vector<float> b_scales;    // [num_b, Kb, N / 128]
  backend::DeviceBuffer d_b, d_b_scales, d_b_ptrs, d_scale_ptrs;
  int64_t scales_per_matrix() const { return int64_t{k / kFp8Block} * (n / kFp8Block); }
  // The dequantized value of weight (w, col, q).
  double value(int w, int col, int q) const {
    return double(model::f8e4m3_to_f32(b[(int64_t{w} * n + col) * k + q])) *
           b_scales[w * scales_per_matrix() + int64_t{q / kFp8Block} * (n / kFp8Block) + col / kFp8Block];
  }
};

inline Fp8Weights make_fp8_weights(int n, int k, int num_b, uint64_t seed) {
  Fp8Weights w;
  w.n = n;
  w.k = k;
  w.num_b = num_b;
  w.b = random_e4m3(int64_t{num_b} * n * k, seed);
  w.b_scales = random_scales(num_b * w.scales_per_matrix(), seed + 1, -12, -8);
  w.d_b = to_device(w.b);
  w.d_b_scales = to_device(w.b_scales);
  std::vector<const uint8_t*> ptrs;
  std::vector<const float*> scale_ptrs;
  for (int q = 0; q < num_b; ++q) {
    ptrs.push_back(w.d_b.as<uint8_t>() + int64_t{q} * n * k);
    scale_ptrs.push_back(w.d_b_scales.as<float>() + q * w.scales_per_matrix());
  }
  w.d_b_ptrs = to_device(ptrs);
  w.d_scale_ptrs = to_device(scale_ptrs);
  return w;
}

// Per-element bound of the FP8 GEMM (derived in gpu_fp8_grouped_gemm_test.cpp):
//   |gpu - ref| <= 2^-8 |ref| + 2^-10 abs_sum + extra   (extra: a caller's own error term, e.g. quantization)
// and ||gpu - ref|| / ||ref|| <= kFp8GemmRelativeL2 over the rows of the groups; ref NaN marks rows outside
// every group, which must still hold the poison (0xffff).
constexpr double kFp8GemmRelativeL2 = 0x1p-8;

inline ::testing::AssertionResult fp8_gemm_matches(const std::vector<uint16_t>& d, const std::vector<float>& ref,
                                                   const std::vector<float>& abs_sum,
                                                   const std::vector<double>& extra = {},
                                                   double relative_l2_bound = kFp8GemmRelativeL2) {
  int64_t bad = 0, poison_lost = 0;
  double worst = 0, err2 = 0, ref2 = 0;
  for (size_t q = 0; q < d.size(); ++q) {
    if (std::isnan(ref[q])) {
      poison_lost += d[q] != 0xffffu;
      continue;
    }
    const double v = model::bf16_bits_to_f32(d[q]);
    const double bound = std::ldexp(std::abs(double(ref[q])), -8) + std::ldexp(double(abs_sum[q]), -10) +
                         (extra.empty() ? 0.0 : extra[q]);
    const double err = std::abs(v - ref[q]);
    if (!(err <= bound)) ++bad;  // NaN fails too
    worst = std::max(worst, std::isfinite(err) ? err / std::max(bound, 1e-30) : INFINITY);
    err2 += std::isfinite(err) ? err * err : INFINITY;
    ref2 += double(ref[q]) * ref[q];
  }
  const double relative_l2 = std::sqrt(err2 / std::max(ref2, 1e-300));
  if (bad == 0 && poison_lost == 0 && relative_l2 <= relative_l2_bound) {
    return ::testing::AssertionSuccess() << "worst error / bound " << worst << ", relative L2 " << relative_l2;
  }
  return ::testing::AssertionFailure() << bad << " elements outside the bound (worst error / bound " << worst
                                       << "), relative L2 " << relative_l2 << " (bound " << relative_l2_bound << "), "
                                       << poison_lost << " elements outside the groups written";
}

// Device, limits, workspace and stream of the FP8 GEMM; skips without an sm_90 device.
class Fp8GemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the FP8 GEMM tests need a GPU";
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
    if (prop.major != 9 || prop.minor != 0) GTEST_SKIP() << "the CUTLASS kernels are built for sm_90a only";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    const gpu::GroupedGemmStatus status = gpu::prepare_fp8_grouped_gemm(0, kMaxGroups, &limits_);
    ASSERT_TRUE(status.ok()) << status.failed << ": " << cudaGetErrorString(cudaError_t(status.cuda_error));
    EXPECT_EQ(limits_.max_groups, kMaxGroups);
    EXPECT_GT(limits_.sm_count, 0);
    EXPECT_GT(limits_.workspace_bytes, limits_.cutlass_workspace_bytes);
    workspace_ = backend::DeviceBuffer(limits_.workspace_bytes);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  static gpu::Fp8GroupedGemmArgs gemm_args(const uint8_t* a, const float* a_scales, const int32_t* offsets,
                                           int num_groups, const Fp8Weights& w, uint16_t* d) {
    gpu::Fp8GroupedGemmArgs args;
    args.a = a;
    args.a_scales = a_scales;
    args.offsets = offsets;
    args.num_groups = num_groups;
    args.b = w.d_b_ptrs.as<const uint8_t*>();
    args.b_scales = w.d_scale_ptrs.as<const float*>();
    args.num_b = w.num_b;
    args.d = d;
    args.n = w.n;
    args.k = w.k;
    return args;
  }
  // Poisons d [rows, N] (bf16 NaN), runs, returns d.
  std::vector<uint16_t> run_gemm(const gpu::Fp8GroupedGemmArgs& args, gpu::Fp8GroupedGemmConfig config, int64_t rows) {
    EXPECT_EQ(cudaMemsetAsync(args.d, 0xff, sizeof(uint16_t) * rows * args.n, stream_), cudaSuccess);
    const gpu::GroupedGemmStatus status = gpu::run_fp8_grouped_gemm(args, config, limits_, workspace_.as<void>(), stream_);
    EXPECT_TRUE(status.ok()) << status.failed;
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return to_host(args.d, rows * args.n);
  }

  static constexpr int kMaxGroups = 288;  // 256 experts + 32 replicas
  gpu::Fp8GroupedGemmLimits limits_;
  backend::DeviceBuffer workspace_;
  cudaStream_t stream_ = nullptr;
};

// Every config, in enum order (kFp8Configs[c] has value c): the tests run each one.
constexpr gpu::Fp8GroupedGemmConfig kFp8Configs[] = {
    gpu::Fp8GroupedGemmConfig::kPingpong64x128x128, gpu::Fp8GroupedGemmConfig::kCooperative128x128x128,
    gpu::Fp8GroupedGemmConfig::kSwapCooperative128x16x128, gpu::Fp8GroupedGemmConfig::kSwapCooperative128x32x128};
static_assert(std::size(kFp8Configs) == gpu::kNumFp8GroupedGemmConfigs, "a config the tests do not run");
inline const char* fp8_config_name(gpu::Fp8GroupedGemmConfig c) { return gpu::fp8_grouped_gemm_config_name(c); }

}  // namespace fulcrum::test
