// The CUTLASS FP8 blockwise grouped GEMM (src/gpu/cutlass/grouped_gemm_fp8.hpp) against the CPU reference
// gpu::reference::fp8_grouped_gemm, with both tile configs: 128 groups of skewed sizes (a 200-row group over
// several tiles, empty groups, one 1-row group; rows outside every group before and after them) at the
// Qwen3-30B-A3B expert shapes (gate_up N 1536 K 2048, down N 2048 K 768) and a small one (N 256 K 256, one
// weight matrix per group); fresh random e4m3 codes over the whole range and log-uniform scales (so a scale
// read from the wrong row or block is off by up to 16x). Then the two configs against each other, one capture
// of setup + GEMM replayed with three device count vectors (each bitwise equal to an eager run), and the
// argument checks (bad shapes, too many groups: refused with a status, nothing launched).
//
// Tolerances and why (ref = the reference's double sum, S = sum_kb |sa sb| sum_k |a b| per element):
//   per element |gpu - ref| <= 2^-8 |ref| + 2^-10 S:
//              bf16 output rounding is at most 2^-9 |value| (doubled for margin). Within a 128-wide k block
//              the products (exact: 4-bit significands) are added by Hopper's FP8 tensor cores, whose
//              accumulator keeps about 13-14 mantissa bits (DeepSeek-V3 report section 3.3.2: "around 14 bits";
//              that is why CUTLASS promotes into fp32 once per block): 4 wgmma k32 steps of 33 additions,
//              each off by at most 2^-13 of the largest product aligned to: 132 * 2^-13 * max |term|, and
//              for these inputs the largest of a block's 128 products is at most ~1/25 of their sum of
//              magnitudes (1/32 typical; 1/25 the worst of 20000 blocks drawn on the CPU), so <= 2^-10.6 of
//              the block's sum of |terms|; the fp32 promotion (Kb multiply-adds, 2^-24 each) is far below
//              that. The probe (../shared/docs/gpu-engine.md) measured 2-3e-3 relative max error and a
//              relative L2 of 1.66e-3, i.e. bf16 rounding alone: the real accumulation error is much smaller.
//   ||gpu - ref|| / ||ref|| <= 2^-8 over the group rows: bf16 rounding alone has an RMS of about
//              2^-8 E[1/m] / sqrt(3) = 1.6e-3 relative (m the significand in [1, 2); the probe measured
//              1.66e-3); a mis-read scale or row gives O(1).
//   pingpong vs cooperative: each element within both bounds added (both run m64n128k32 wgmma steps and
//              promote per block in the same order, so they are expected bitwise equal; the count of
//              differing elements is printed, not asserted)
//   exact      rows outside every group (still the poison), replayed graphs vs eager runs, refused calls
//              write nothing
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "fp8_test_util.hpp"
#include "gpu/cutlass/grouped_gemm_fp8.hpp"
#include "gpu/reference/fp8_reference.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using gpu::Fp8GroupedGemmConfig;

// Activations of one grouped GEMM on the host and the device: rows [0, offsets[0]) and the last 2 rows
// belong to no group.
struct Fp8Activations {
  int k = 0;
  std::vector<int32_t> offsets;  // [G + 1]
  int64_t rows = 0;
  std::vector<uint8_t> a;        // [rows, K] e4m3
  std::vector<float> a_scales;   // [rows * Kb], per group [Kb][m] at offsets[g] * Kb
  DeviceBuffer d_a, d_a_scales, d_offsets, d_out;
};

Fp8Activations make_activations(int n, int k, const std::vector<int32_t>& offsets, int64_t rows, uint64_t seed) {
  Fp8Activations x;
  x.k = k;
  x.offsets = offsets;
  x.rows = rows;
  x.a = random_e4m3(rows * k, seed);
  x.a_scales = random_scales(rows * (k / kFp8Block), seed + 1, -10, -6);
  x.d_a = to_device(x.a);
  x.d_a_scales = to_device(x.a_scales);
  x.d_offsets = to_device(x.offsets);
  x.d_out = DeviceBuffer(sizeof(uint16_t) * rows * n);
  return x;
}

struct Fp8Reference {
  std::vector<float> d, abs_sum;  // [rows, N]; d NaN outside the groups
};

Fp8Reference reference_of(const Fp8Activations& x, const std::vector<int32_t>& offsets, const Fp8Weights& w) {
  Fp8Reference r;
  r.d.assign(static_cast<size_t>(x.rows * w.n), NAN);
  r.abs_sum.assign(r.d.size(), 0.0f);
  gpu::reference::fp8_grouped_gemm(x.a, x.a_scales, offsets, w.b, w.b_scales, w.num_b, w.n, w.k, r.d, r.abs_sum);
  return r;
}

class Fp8GroupedGemmTest : public Fp8GemmTest {
 protected:
  gpu::Fp8GroupedGemmArgs args_of(const Fp8Activations& x, const Fp8Weights& w) const {
    return gemm_args(x.d_a.as<uint8_t>(), x.d_a_scales.as<float>(), x.d_offsets.as<int32_t>(),
                     static_cast<int>(x.offsets.size()) - 1, w, x.d_out.as<uint16_t>());
  }
};

TEST_F(Fp8GroupedGemmTest, MatchesReferenceAtExpertShapesWithSkewedGroups) {
  struct Shape {
    int n, k, num_b;
  };
  const std::vector<int32_t> counts = skewed_counts(128, 200, 11);
  ASSERT_EQ(std::count(counts.begin(), counts.end(), 1), 1);
  ASSERT_GT(std::count(counts.begin(), counts.end(), 0), 10);
  const std::vector<int32_t> offsets = offsets_from(counts, 3);
  const int64_t rows = offsets.back() + 2;
  // num_b 8: groups share weight matrices (g % 8); 128: one per group.
  for (const Shape s : {Shape{1536, 2048, 8}, Shape{2048, 768, 8}, Shape{256, 256, 128}}) {
    const Fp8Weights w = make_fp8_weights(s.n, s.k, s.num_b, 100 + s.n + s.k);
    const Fp8Activations x = make_activations(s.n, s.k, offsets, rows, 200 + s.n + s.k);
    const Fp8Reference ref = reference_of(x, offsets, w);
    std::vector<uint16_t> outputs[gpu::kNumFp8GroupedGemmConfigs];
    for (const Fp8GroupedGemmConfig config : kFp8Configs) {
      SCOPED_TRACE(fmt::format("N {} K {} {}", s.n, s.k, fp8_config_name(config)));
      outputs[static_cast<int>(config)] = run_gemm(args_of(x, w), config, rows);
      const auto result = fp8_gemm_matches(outputs[static_cast<int>(config)], ref.d, ref.abs_sum);
      EXPECT_TRUE(result);
      fmt::print("  FP8 grouped GEMM N {} K {} {} ({} rows): {}\n", s.n, s.k, fp8_config_name(config),
                 offsets.back() - offsets.front(), result.message());
    }
    // Each config against the first: within both bounds; bitwise differences counted.
    for (int c = 1; c < gpu::kNumFp8GroupedGemmConfigs; ++c) {
      int64_t differ = 0, apart = 0;
      for (size_t q = 0; q < ref.d.size(); ++q) {
        if (std::isnan(ref.d[q])) continue;
        differ += outputs[0][q] != outputs[c][q];
        const double gap =
            std::abs(double(model::bf16_bits_to_f32(outputs[0][q])) - model::bf16_bits_to_f32(outputs[c][q]));
        apart += !(gap <= 2 * (std::ldexp(std::abs(double(ref.d[q])), -8) + std::ldexp(double(ref.abs_sum[q]), -10)));
      }
      EXPECT_EQ(apart, 0) << "elements where " << fp8_config_name(kFp8Configs[c])
                          << " and pingpong differ by more than both bounds";
      fmt::print("  FP8 grouped GEMM N {} K {}: {} and {} differ in {} of {} elements\n", s.n, s.k,
                 fp8_config_name(kFp8Configs[0]), fp8_config_name(kFp8Configs[c]), differ,
                 (offsets.back() - offsets.front()) * int64_t{s.n});
    }
  }
}

// The same rows cut into other groups of the same weights (replicas split, slots emptied): each row's output
// bitwise unchanged in every config, since a row's bits may depend only on its own row, scales and weights
// (placement invariance, grouped_gemm_fp8.hpp). The swapped configs put a group's rows on the tile's N side,
// so this is where a tile-width dependence would show. The activation scales are repacked for the new groups.
TEST_F(Fp8GroupedGemmTest, RegroupingRowsDoesNotChangeTheirBits) {
  const int n = 2048, k = 768, k_blocks = k / kFp8Block;
  const std::vector<int32_t> first = offsets_from({300, 7, 1, 0}, 3), second = offsets_from({150, 150, 0, 5, 2, 1}, 3);
  ASSERT_EQ(first.back(), second.back());
  const int64_t rows = first.back() + 2;
  const Fp8Weights w = make_fp8_weights(n, k, 1, 41);  // one weight matrix: every group is a replica of it
  const Fp8Activations x = make_activations(n, k, first, rows, 42);
  // Scale (row r, block kb) of group g (first row f, m rows) lies at f * Kb + kb * m + (r - f).
  const auto scale_index = [&](const std::vector<int32_t>& offsets, int64_t r, int kb) {
    const size_t g = static_cast<size_t>(std::upper_bound(offsets.begin(), offsets.end(), r) - offsets.begin()) - 1;
    const int64_t f = offsets[g], m = offsets[g + 1] - f;
    return f * k_blocks + kb * m + (r - f);
  };
  Fp8Activations y;
  y.k = k;
  y.offsets = second;
  y.rows = rows;
  y.a = x.a;
  y.a_scales = x.a_scales;
  for (int64_t r = first.front(); r < first.back(); ++r) {
    for (int kb = 0; kb < k_blocks; ++kb) y.a_scales[scale_index(second, r, kb)] = x.a_scales[scale_index(first, r, kb)];
  }
  y.d_a = to_device(y.a);
  y.d_a_scales = to_device(y.a_scales);
  y.d_offsets = to_device(y.offsets);
  y.d_out = DeviceBuffer(sizeof(uint16_t) * rows * n);
  const Fp8Reference ref = reference_of(x, first, w);
  for (const Fp8GroupedGemmConfig config : kFp8Configs) {
    SCOPED_TRACE(fp8_config_name(config));
    const std::vector<uint16_t> out_first = run_gemm(args_of(x, w), config, rows);
    const std::vector<uint16_t> out_second = run_gemm(args_of(y, w), config, rows);
    int64_t differ = 0;
    for (int64_t r = 0; r < rows; ++r) {
      differ += !std::equal(out_first.begin() + r * n, out_first.begin() + (r + 1) * n, out_second.begin() + r * n);
    }
    EXPECT_EQ(differ, 0) << "rows whose output changed with the grouping";
    EXPECT_TRUE(fp8_gemm_matches(out_first, ref.d, ref.abs_sum));
  }
}

// Setup kernel + GEMM captured once (global capture mode: a host sync or allocation inside would fail the
// capture), replayed with three count vectors written on the device (skewed, uniform, one row among empty
// groups): each replay bitwise equal to an eager run of the same counts and within the reference bound.
TEST_F(Fp8GroupedGemmTest, CapturedOnceReplaysWithNewCounts) {
  const int n = 512, k = 512, groups = 128;
  std::vector<int32_t> one_row(groups, 0);
  one_row[77] = 1;
  const std::vector<std::vector<int32_t>> count_sets = {skewed_counts(groups, 150, 5), std::vector<int32_t>(groups, 3),
                                                        one_row};
  int64_t rows = 0;
  for (const auto& counts : count_sets) rows = std::max<int64_t>(rows, offsets_from(counts, 0).back() + 2);
  const Fp8Weights w = make_fp8_weights(n, k, 16, 31);
  const Fp8Activations x = make_activations(n, k, offsets_from(count_sets[0], 0), rows, 32);
  for (const Fp8GroupedGemmConfig config : kFp8Configs) {
    SCOPED_TRACE(fp8_config_name(config));
    ASSERT_EQ(cudaMemcpy(x.d_offsets.as<int32_t>(), x.offsets.data(), sizeof(int32_t) * x.offsets.size(),
                         cudaMemcpyHostToDevice), cudaSuccess);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
    const gpu::GroupedGemmStatus status =
        gpu::run_fp8_grouped_gemm(args_of(x, w), config, limits_, workspace_.as<void>(), stream_);
    ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
    ASSERT_TRUE(status.ok()) << status.failed;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (const auto& counts : count_sets) {
      const std::vector<int32_t> offsets = offsets_from(counts, 0);
      ASSERT_EQ(cudaMemcpyAsync(x.d_offsets.as<int32_t>(), offsets.data(), sizeof(int32_t) * offsets.size(),
                                cudaMemcpyHostToDevice, stream_), cudaSuccess);
      ASSERT_EQ(cudaMemsetAsync(x.d_out.as<void>(), 0xff, x.d_out.bytes(), stream_), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      const std::vector<uint16_t> replayed = to_host(x.d_out.as<uint16_t>(), rows * n);
      const Fp8Reference ref = reference_of(x, offsets, w);
      EXPECT_TRUE(fp8_gemm_matches(replayed, ref.d, ref.abs_sum)) << "rows " << offsets.back();
      // Eager run of the same counts (the offsets are already on the device).
      EXPECT_EQ(replayed, run_gemm(args_of(x, w), config, rows)) << "replay vs eager, rows " << offsets.back();
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// Refused calls return a status and launch nothing: d keeps its poison after the stream drains.
TEST_F(Fp8GroupedGemmTest, RefusedCallsLaunchNothing) {
  const int n = 256, k = 256;
  const std::vector<int32_t> offsets = offsets_from({4, 0, 9}, 0);
  const Fp8Weights w = make_fp8_weights(n, k, 3, 41);
  const Fp8Activations x = make_activations(n, k, offsets, offsets.back(), 42);
  ASSERT_EQ(cudaMemset(x.d_out.as<void>(), 0xff, x.d_out.bytes()), cudaSuccess);
  const auto refused = [&](gpu::Fp8GroupedGemmArgs args, const char* what) {
    const gpu::GroupedGemmStatus status =
        gpu::run_fp8_grouped_gemm(args, Fp8GroupedGemmConfig::kPingpong64x128x128, limits_, workspace_.as<void>(), stream_);
    EXPECT_FALSE(status.ok()) << what;
    EXPECT_NE(status.cuda_error, 0) << what;
  };
  gpu::Fp8GroupedGemmArgs args = args_of(x, w);
  args.k = 200;  // not whole 128-wide blocks
  refused(args, "K 200");
  args.k = 64;
  refused(args, "K 64");
  args = args_of(x, w);
  args.n = 200;
  refused(args, "N 200");
  args = args_of(x, w);
  args.num_groups = kMaxGroups + 1;
  refused(args, "more groups than prepared");
  args = args_of(x, w);
  args.a_scales = nullptr;
  refused(args, "null a_scales");
  args = args_of(x, w);
  args.a = x.d_a.as<uint8_t>() + 8;
  refused(args, "a not 16-byte aligned");
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<uint16_t> d = to_host(x.d_out.as<uint16_t>(), int64_t{offsets.back()} * n);
  EXPECT_EQ(std::count(d.begin(), d.end(), uint16_t{0xffff}), static_cast<std::ptrdiff_t>(d.size())) << "refused calls wrote d";
  // Zero groups: success, nothing runs.
  args = args_of(x, w);
  args.num_groups = 0;
  EXPECT_TRUE(gpu::run_fp8_grouped_gemm(args, Fp8GroupedGemmConfig::kCooperative128x128x128, limits_,
                                        workspace_.as<void>(), stream_).ok());
}

TEST(Fp8GroupedGemmRules, ConfigByTotalRowsShapeRuleAndArgumentChecks) {
  EXPECT_EQ(gpu::fp8_grouped_gemm_config_for_rows(0), Fp8GroupedGemmConfig::kSwapCooperative128x32x128);
  EXPECT_EQ(gpu::fp8_grouped_gemm_config_for_rows(2048), Fp8GroupedGemmConfig::kSwapCooperative128x32x128);
  EXPECT_EQ(gpu::fp8_grouped_gemm_config_for_rows(2049), Fp8GroupedGemmConfig::kPingpong64x128x128);
  EXPECT_EQ(gpu::fp8_grouped_gemm_config_for_rows(16383), Fp8GroupedGemmConfig::kPingpong64x128x128);
  EXPECT_EQ(gpu::fp8_grouped_gemm_config_for_rows(16384), Fp8GroupedGemmConfig::kCooperative128x128x128);
  for (const Fp8GroupedGemmConfig config : kFp8Configs) {  // names distinct (bench JSON keys)
    for (const Fp8GroupedGemmConfig other : kFp8Configs) {
      EXPECT_EQ(config == other, std::string(gpu::fp8_grouped_gemm_config_name(config)) ==
                                     gpu::fp8_grouped_gemm_config_name(other));
    }
  }
  EXPECT_EQ(gpu::fp8_grouped_gemm_shape_problem(1536, 2048), nullptr);
  EXPECT_EQ(gpu::fp8_grouped_gemm_shape_problem(2048, 768), nullptr);
  EXPECT_NE(gpu::fp8_grouped_gemm_shape_problem(1536, 2000), nullptr);
  EXPECT_NE(gpu::fp8_grouped_gemm_shape_problem(1500, 2048), nullptr);
  EXPECT_NE(gpu::fp8_grouped_gemm_shape_problem(0, 128), nullptr);
  // Checks that fail before any launch (host buffers stand in for device ones: a launch would fault).
  gpu::Fp8GroupedGemmLimits limits;
  limits.max_groups = 4;
  gpu::Fp8GroupedGemmArgs args;
  args.num_groups = 0;
  EXPECT_TRUE(gpu::run_fp8_grouped_gemm(args, Fp8GroupedGemmConfig::kPingpong64x128x128, limits, nullptr, nullptr).ok());
  alignas(16) static uint8_t bytes[512];
  alignas(16) static float scales[16];
  alignas(16) static uint16_t out[256];
  const uint8_t* b_ptrs[1] = {bytes};
  const float* scale_ptrs[1] = {scales};
  const int32_t offsets[3] = {0, 1, 2};
  args.a = bytes;
  args.a_scales = scales;
  args.offsets = offsets;
  args.num_groups = 2;
  args.b = b_ptrs;
  args.b_scales = scale_ptrs;
  args.num_b = 1;
  args.d = out;
  args.n = args.k = 128;
  gpu::Fp8GroupedGemmArgs bad = args;
  bad.num_groups = 5;
  EXPECT_FALSE(gpu::run_fp8_grouped_gemm(bad, Fp8GroupedGemmConfig::kPingpong64x128x128, limits, out, nullptr).ok());
  bad = args;
  bad.k = 192;
  EXPECT_FALSE(gpu::run_fp8_grouped_gemm(bad, Fp8GroupedGemmConfig::kPingpong64x128x128, limits, out, nullptr).ok());
  bad = args;
  bad.n = 136;
  EXPECT_FALSE(gpu::run_fp8_grouped_gemm(bad, Fp8GroupedGemmConfig::kCooperative128x128x128, limits, out, nullptr).ok());
  bad = args;
  bad.b_scales = nullptr;
  EXPECT_FALSE(gpu::run_fp8_grouped_gemm(bad, Fp8GroupedGemmConfig::kPingpong64x128x128, limits, out, nullptr).ok());
  bad = args;
  bad.num_b = 0;
  EXPECT_FALSE(gpu::run_fp8_grouped_gemm(bad, Fp8GroupedGemmConfig::kPingpong64x128x128, limits, out, nullptr).ok());
  bad = args;
  bad.d = out + 1;  // 2-byte aligned only
  EXPECT_FALSE(gpu::run_fp8_grouped_gemm(bad, Fp8GroupedGemmConfig::kPingpong64x128x128, limits, out, nullptr).ok());
  EXPECT_FALSE(gpu::run_fp8_grouped_gemm(args, Fp8GroupedGemmConfig::kPingpong64x128x128, limits, nullptr, nullptr).ok())
      << "null workspace";
  EXPECT_FALSE(gpu::prepare_fp8_grouped_gemm(0, 0, &limits).ok()) << "max_groups 0";
}

}  // namespace
}  // namespace fulcrum::test
