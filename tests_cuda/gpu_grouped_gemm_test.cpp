// The CUTLASS bf16 grouped GEMM (src/gpu/cutlass/grouped_gemm.hpp) against a CPU reference of the same bf16
// inputs, with every tile config (the swapped-operand ones too): groups of 0, 1, 7, 300 and 13 rows (rows
// outside every group before and after them), the Qwen3-30B-A3B expert shapes (gate_up N 1536 K 2048, down N 2048 K 768), the Qwen3-235B-A22B
// ones (N 3072 K 4096, N 4096 K 1536) and the tiny test model's (hidden 64, moe_intermediate 16: N 32 K 64,
// N 64 K 16, K below one 64-wide k-tile); weights shared by several groups (b[g % num_b]); a row's bits
// independent of its group's size and position; one capture replayed with other device offsets.
//
// Tolerances and why:
//   per element |gpu - ref| <= 2^-8 |ref| + 2^-16 sum_k |a_k b_k|, ref = the sum in double: the GPU rounds
//              its fp32 sum to bf16 (at most 2^-9 relative, doubled for margin) and its fp32 accumulation in
//              another order adds at most about sqrt(K) 2^-24 sum |a b| (random signs; 2^-16 leaves > 4x margin
//              at K = 4096); every element is checked, unwritten ones (NaN poison) fail
//   exact      rows outside every group (still the poison), a row's output under another placement of the
//              groups (same config), replayed graphs vs the eager run
//   exact      the pair's one setup launch then each GEMM vs two run_grouped_gemm calls
//   host rules config choice by total rows, the shape rule, argument checks (no GPU needed)
#include <cmath>
#include <cstring>
#include <iterator>
#include <numeric>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "gpu/cutlass/grouped_gemm.hpp"
#include "model/parallel_chunks.hpp"
#include "moe_cuda_test_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using gpu::GroupedGemmConfig;

constexpr GroupedGemmConfig kConfigs[] = {
    GroupedGemmConfig::kPingpong64x128x64, GroupedGemmConfig::kCooperative256x128x64,
    GroupedGemmConfig::kPingpong128x128x64, GroupedGemmConfig::kSwapCooperative128x16x128,
    GroupedGemmConfig::kSwapCooperative128x32x128};
static_assert(std::size(kConfigs) == gpu::kNumGroupedGemmConfigs, "every config is tested");
const char* config_name(GroupedGemmConfig c) {
  switch (c) {
    case GroupedGemmConfig::kPingpong64x128x64: return "pingpong64x128x64";
    case GroupedGemmConfig::kCooperative256x128x64: return "cooperative256x128x64";
    case GroupedGemmConfig::kPingpong128x128x64: return "pingpong128x128x64";
    case GroupedGemmConfig::kSwapCooperative128x16x128: return "swap_cooperative128x16x128";
    case GroupedGemmConfig::kSwapCooperative128x32x128: return "swap_cooperative128x32x128";
  }
  return "?";
}

// One grouped GEMM's inputs on the host: rows [0, first_row) and the last 2 rows belong to no group.
struct HostProblem {
  int n = 0, k = 0, num_b = 0;
  std::vector<int32_t> offsets;  // [G + 1]
  int64_t rows = 0;
  std::vector<float> a;          // [rows, K] bf16 values
  std::vector<float> b;          // [num_b, N, K] bf16 values
};

HostProblem make_problem(int n, int k, const std::vector<int32_t>& counts, int num_b, int first_row, uint64_t seed) {
  HostProblem p;
  p.n = n;
  p.k = k;
  p.num_b = num_b;
  p.offsets.push_back(first_row);
  for (const int32_t c : counts) p.offsets.push_back(p.offsets.back() + c);
  p.rows = p.offsets.back() + 2;
  p.a = random_bf16_values(p.rows * k, seed, 1.0f);
  p.b = random_bf16_values(int64_t{num_b} * n * k, seed + 1, 1.0f / std::sqrt(float(k)));
  return p;
}

// ref [rows, N] (NaN outside the groups) and sum_k |a b| per element.
struct Reference {
  std::vector<double> d, abs_sum;
};

Reference reference_of(const HostProblem& p) {
  Reference r;
  r.d.assign(static_cast<size_t>(p.rows * p.n), NAN);
  r.abs_sum.assign(r.d.size(), 0.0);
  const int groups = static_cast<int>(p.offsets.size()) - 1;
  for (int g = 0; g < groups; ++g) {
    const float* w = p.b.data() + int64_t{g % p.num_b} * p.n * p.k;  // [N, K]
    const int64_t first = p.offsets[g], rows = p.offsets[g + 1] - first;
    model::parallel_chunks(rows, int64_t{p.n} * p.k, [&](int64_t begin, int64_t end) {
      for (int64_t row = first + begin; row < first + end; ++row) {
        const float* x = p.a.data() + row * p.k;
        for (int col = 0; col < p.n; ++col) {
          double sum = 0, abs_sum = 0;
          for (int q = 0; q < p.k; ++q) {
            const double term = double(x[q]) * w[int64_t{col} * p.k + q];
            sum += term;
            abs_sum += std::abs(term);
          }
          r.d[row * p.n + col] = sum;
          r.abs_sum[row * p.n + col] = abs_sum;
        }
      }
    });
  }
  return r;
}

// Every element within the bound (rows in groups) or still the poison (other rows).
::testing::AssertionResult matches_reference(const std::vector<uint16_t>& d, const Reference& r) {
  int64_t bad = 0, poison_lost = 0;
  double worst = 0;
  for (size_t q = 0; q < d.size(); ++q) {
    if (std::isnan(r.d[q])) {
      poison_lost += d[q] != 0xffffu;
      continue;
    }
    const double v = model::bf16_bits_to_f32(d[q]);
    const double bound = std::ldexp(std::abs(r.d[q]), -8) + std::ldexp(r.abs_sum[q], -16);
    const double err = std::abs(v - r.d[q]);
    if (!(err <= bound)) ++bad;  // NaN fails too
    worst = std::max(worst, std::isfinite(err) ? err / std::max(bound, 1e-30) : INFINITY);
  }
  if (bad == 0 && poison_lost == 0) return ::testing::AssertionSuccess() << "worst error / bound " << worst;
  return ::testing::AssertionFailure() << bad << " elements outside the bound (worst error / bound " << worst << "), "
                                       << poison_lost << " elements outside the groups written";
}

class GroupedGemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the grouped GEMM tests need a GPU";
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
    if (prop.major != 9 || prop.minor != 0) GTEST_SKIP() << "the CUTLASS kernels are built for sm_90a only";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    const gpu::GroupedGemmStatus status = gpu::prepare_grouped_gemm(0, kMaxGroups, &limits_);
    ASSERT_TRUE(status.ok()) << status.failed << ": " << cudaGetErrorString(cudaError_t(status.cuda_error));
    EXPECT_EQ(limits_.max_groups, kMaxGroups);
    EXPECT_GT(limits_.sm_count, 0);
    workspace_ = DeviceBuffer(limits_.workspace_bytes);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // A problem on the device: a, the weights, their pointer array, the offsets, d.
  struct DeviceProblem {
    DeviceBuffer a, b, b_ptrs, offsets, d;
  };
  DeviceProblem upload(const HostProblem& p) {
    DeviceProblem dp;
    dp.a = to_device(to_bits(p.a));
    dp.b = to_device(to_bits(p.b));
    std::vector<const uint16_t*> ptrs;
    for (int q = 0; q < p.num_b; ++q) ptrs.push_back(dp.b.as<uint16_t>() + int64_t{q} * p.n * p.k);
    dp.b_ptrs = to_device(ptrs);
    dp.offsets = to_device(p.offsets);
    dp.d = DeviceBuffer(sizeof(uint16_t) * p.rows * p.n);
    return dp;
  }
  gpu::GroupedGemmArgs args_of(const HostProblem& p, const DeviceProblem& dp) const {
    gpu::GroupedGemmArgs args;
    args.a = dp.a.as<uint16_t>();
    args.offsets = dp.offsets.as<int32_t>();
    args.num_groups = static_cast<int>(p.offsets.size()) - 1;
    args.b = dp.b_ptrs.as<const uint16_t*>();
    args.num_b = p.num_b;
    args.d = dp.d.as<uint16_t>();
    args.n = p.n;
    args.k = p.k;
    return args;
  }
  // Poisons d (bf16 NaN), runs, returns d.
  std::vector<uint16_t> run(const HostProblem& p, const DeviceProblem& dp, GroupedGemmConfig config) {
    EXPECT_EQ(cudaMemsetAsync(dp.d.as<void>(), 0xff, dp.d.bytes(), stream_), cudaSuccess);
    const gpu::GroupedGemmStatus status = gpu::run_grouped_gemm(args_of(p, dp), config, limits_, workspace_.as<void>(), stream_);
    EXPECT_TRUE(status.ok()) << status.failed;
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return to_host(dp.d.as<uint16_t>(), p.rows * p.n);
  }

  static constexpr int kMaxGroups = 288;  // 256 experts + 32 replicas
  gpu::GroupedGemmLimits limits_;
  DeviceBuffer workspace_;
  cudaStream_t stream_ = nullptr;
};

TEST_F(GroupedGemmTest, MatchesReferenceAtExpertShapes) {
  struct Shape {
    int n, k, num_b;
  };
  // num_b 6: one weight matrix per group; 2: groups share them (g % 2).
  for (const Shape s : {Shape{1536, 2048, 6}, Shape{2048, 768, 6}, Shape{3072, 4096, 6}, Shape{4096, 1536, 2},
                        Shape{32, 64, 6}, Shape{64, 16, 2}}) {
    const HostProblem p = make_problem(s.n, s.k, {0, 1, 7, 300, 0, 13}, s.num_b, 3, 100 + s.n + s.k);
    const Reference ref = reference_of(p);
    const DeviceProblem dp = upload(p);
    for (const GroupedGemmConfig config : kConfigs) {
      SCOPED_TRACE(fmt::format("N {} K {} {}", s.n, s.k, config_name(config)));
      const auto result = matches_reference(run(p, dp, config), ref);
      EXPECT_TRUE(result);
      fmt::print("  grouped GEMM N {} K {} {}: {}\n", s.n, s.k, config_name(config), result.message());
    }
  }
}

// The rows of weights 0 (300 rows), 1 (7) and 2 (1) in groups [300 | 7 | 1 | 0] at row 0, and again as
// [7 | 0 | 120 | 1 | 180] starting at row 5 (weights 0's rows split into two groups that share its weights,
// as replicas of a hot expert): every row bitwise the same output, at every config.
TEST_F(GroupedGemmTest, PlacementDoesNotChangeARowsBits) {
  const int n = 2048, k = 768;
  HostProblem first = make_problem(n, k, {300, 7, 1, 0}, 4, 0, 7);
  // Second placement: groups (weights) 1, 3, 0, 2, 0; rows moved with their group.
  HostProblem second = make_problem(n, k, {7, 0, 120, 1, 180}, 5, 5, 8);
  const int weights_of_second[] = {1, 3, 0, 2, 0};
  for (int g = 0; g < 5; ++g) {
    const int w = weights_of_second[g];
    std::copy(first.b.begin() + int64_t{w} * n * k, first.b.begin() + int64_t{w + 1} * n * k,
              second.b.begin() + int64_t{g} * n * k);
  }
  // Row of `second` for each row of `first`.
  std::vector<int64_t> moved_to(static_cast<size_t>(first.rows), -1);
  const auto place = [&](int64_t from_row, int64_t count, int64_t to_row) {
    for (int64_t q = 0; q < count; ++q) {
      moved_to[from_row + q] = to_row + q;
      std::copy(first.a.begin() + (from_row + q) * k, first.a.begin() + (from_row + q + 1) * k,
                second.a.begin() + (to_row + q) * k);
    }
  };
  place(300, 7, second.offsets[0]);        // weights 1
  place(0, 120, second.offsets[2]);        // weights 0, first replica
  place(307, 1, second.offsets[3]);        // weights 2
  place(120, 180, second.offsets[4]);      // weights 0, second replica
  const DeviceProblem d_first = upload(first), d_second = upload(second);
  for (const GroupedGemmConfig config : kConfigs) {
    SCOPED_TRACE(config_name(config));
    const std::vector<uint16_t> out_first = run(first, d_first, config), out_second = run(second, d_second, config);
    int64_t differ = 0;
    for (int64_t row = 0; row < first.offsets.back(); ++row) {
      ASSERT_GE(moved_to[row], 0);
      differ += !std::equal(out_first.begin() + row * n, out_first.begin() + (row + 1) * n,
                            out_second.begin() + moved_to[row] * n);
    }
    EXPECT_EQ(differ, 0) << "rows whose output changed with the placement";
    EXPECT_TRUE(matches_reference(out_first, reference_of(first)));
  }
}

// Setup kernel + GEMM captured once (global capture mode: a host sync or allocation inside would fail the
// capture), replayed with other offsets written on the device: uniform groups, one full group, all empty,
// one row; each replay vs the reference and bitwise vs an eager run of the same offsets.
TEST_F(GroupedGemmTest, CapturedOnceReplaysWithNewOffsets) {
  const int n = 2048, k = 768, groups = 16;
  const std::vector<std::vector<int32_t>> count_sets = {
      std::vector<int32_t>(groups, 16), {0, 0, 0, 300, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
      std::vector<int32_t>(groups, 0), {0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}};
  HostProblem p = make_problem(n, k, count_sets[0], groups, 0, 9);
  p.rows = 300 + 2;  // room for the largest set
  p.a = random_bf16_values(p.rows * k, 10, 1.0f);
  const DeviceProblem dp = upload(p);
  for (const GroupedGemmConfig config : kConfigs) {
    SCOPED_TRACE(config_name(config));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
    const gpu::GroupedGemmStatus status = gpu::run_grouped_gemm(args_of(p, dp), config, limits_, workspace_.as<void>(), stream_);
    ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
    ASSERT_TRUE(status.ok()) << status.failed;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (const auto& counts : count_sets) {
      HostProblem q = p;
      q.offsets.assign(1, 0);
      for (const int32_t c : counts) q.offsets.push_back(q.offsets.back() + c);
      ASSERT_EQ(cudaMemcpyAsync(dp.offsets.as<int32_t>(), q.offsets.data(), sizeof(int32_t) * q.offsets.size(),
                                cudaMemcpyHostToDevice, stream_), cudaSuccess);
      ASSERT_EQ(cudaMemsetAsync(dp.d.as<void>(), 0xff, dp.d.bytes(), stream_), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      const std::vector<uint16_t> replayed = to_host(dp.d.as<uint16_t>(), p.rows * n);
      EXPECT_TRUE(matches_reference(replayed, reference_of(q))) << "rows " << q.offsets.back();
      EXPECT_EQ(replayed, run(q, dp, config)) << "replay vs eager, rows " << q.offsets.back();
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// The MoE pair's two-step form: one setup launch for both GEMMs (the gate_up and down shapes of 30B-A3B over the
// same groups), then each GEMM alone, the second's A written only after the setup and the first GEMM (as SwiGLU
// writes it), with a kernel of the caller's between. Both outputs bitwise those of run_grouped_gemm, within the
// reference's bound, at every config.
TEST_F(GroupedGemmTest, PairSetupThenEachGemmEqualsTwoRuns) {
  const std::vector<int32_t> counts = {0, 1, 7, 300, 0, 13};
  const HostProblem up = make_problem(1536, 2048, counts, 6, 3, 21);
  const HostProblem down = make_problem(2048, 768, counts, 6, 3, 22);
  const DeviceProblem d_up = upload(up), d_down = upload(down);
  const std::vector<uint16_t> down_a = to_bits(down.a);
  for (const GroupedGemmConfig config : kConfigs) {
    SCOPED_TRACE(config_name(config));
    const std::vector<uint16_t> up_alone = run(up, d_up, config), down_alone = run(down, d_down, config);
    ASSERT_EQ(cudaMemsetAsync(d_up.d.as<void>(), 0xff, d_up.d.bytes(), stream_), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d_down.d.as<void>(), 0xff, d_down.d.bytes(), stream_), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d_down.a.as<void>(), 0xff, d_down.a.bytes(), stream_), cudaSuccess);
    const gpu::GroupedGemmArgs first = args_of(up, d_up), second = args_of(down, d_down);
    void* ws = workspace_.as<void>();
    gpu::GroupedGemmStatus status = gpu::setup_grouped_gemm_pair(first, second, config, limits_, ws, stream_);
    ASSERT_TRUE(status.ok()) << status.failed;
    status = gpu::launch_grouped_gemm(first, 0, config, limits_, ws, stream_);
    ASSERT_TRUE(status.ok()) << status.failed;
    ASSERT_EQ(cudaMemcpyAsync(d_down.a.as<void>(), down_a.data(), d_down.a.bytes(), cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    status = gpu::launch_grouped_gemm(second, 1, config, limits_, ws, stream_);
    ASSERT_TRUE(status.ok()) << status.failed;
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const std::vector<uint16_t> up_paired = to_host(d_up.d.as<uint16_t>(), up.rows * up.n);
    const std::vector<uint16_t> down_paired = to_host(d_down.d.as<uint16_t>(), down.rows * down.n);
    EXPECT_EQ(up_paired, up_alone);
    EXPECT_EQ(down_paired, down_alone);
    EXPECT_TRUE(matches_reference(down_paired, reference_of(down)));
  }
}

TEST(GroupedGemmRules, ConfigByTotalRowsShapeRuleAndArgumentChecks) {
  EXPECT_EQ(gpu::grouped_gemm_config_for_rows(0), GroupedGemmConfig::kSwapCooperative128x16x128);
  EXPECT_EQ(gpu::grouped_gemm_config_for_rows(1024), GroupedGemmConfig::kSwapCooperative128x16x128);
  EXPECT_EQ(gpu::grouped_gemm_config_for_rows(1025), GroupedGemmConfig::kSwapCooperative128x32x128);
  EXPECT_EQ(gpu::grouped_gemm_config_for_rows(2048), GroupedGemmConfig::kSwapCooperative128x32x128);
  EXPECT_EQ(gpu::grouped_gemm_config_for_rows(2049), GroupedGemmConfig::kPingpong64x128x64);
  EXPECT_EQ(gpu::grouped_gemm_config_for_rows(16383), GroupedGemmConfig::kPingpong64x128x64);
  EXPECT_EQ(gpu::grouped_gemm_config_for_rows(16384), GroupedGemmConfig::kPingpong128x128x64);
  EXPECT_EQ(gpu::grouped_gemm_shape_problem(1536, 2048), nullptr);
  EXPECT_EQ(gpu::grouped_gemm_shape_problem(32, 16), nullptr);
  EXPECT_NE(gpu::grouped_gemm_shape_problem(44, 50), nullptr);  // hidden 50 / intermediate 22
  EXPECT_NE(gpu::grouped_gemm_shape_problem(48, 22), nullptr);
  EXPECT_NE(gpu::grouped_gemm_shape_problem(0, 8), nullptr);
  // Checks that fail before any launch.
  gpu::GroupedGemmLimits limits;
  limits.max_groups = 4;
  gpu::GroupedGemmArgs args;
  args.num_groups = 0;
  EXPECT_TRUE(gpu::run_grouped_gemm(args, GroupedGemmConfig::kPingpong64x128x64, limits, nullptr, nullptr).ok());
  args.num_groups = 5;
  args.n = args.k = 64;
  EXPECT_FALSE(gpu::run_grouped_gemm(args, GroupedGemmConfig::kPingpong64x128x64, limits, nullptr, nullptr).ok());
  args.num_groups = 2;
  EXPECT_FALSE(gpu::run_grouped_gemm(args, GroupedGemmConfig::kPingpong64x128x64, limits, nullptr, nullptr).ok());  // null pointers
  alignas(16) static uint16_t buffer[64];
  const uint16_t* b_ptrs[1] = {buffer};
  const int32_t offsets[3] = {0, 1, 2};
  args.a = buffer + 1;  // 2-byte aligned only
  args.offsets = offsets;
  args.b = b_ptrs;
  args.num_b = 1;
  args.d = buffer;
  EXPECT_FALSE(gpu::run_grouped_gemm(args, GroupedGemmConfig::kPingpong64x128x64, limits, buffer, nullptr).ok());
  args.a = buffer;
  args.k = 22;
  EXPECT_FALSE(gpu::run_grouped_gemm(args, GroupedGemmConfig::kPingpong64x128x64, limits, buffer, nullptr).ok());
  EXPECT_FALSE(gpu::setup_grouped_gemm_pair(args, args, GroupedGemmConfig::kPingpong64x128x64, limits, buffer, nullptr)
                   .ok());
  args.k = 64;
  for (const int region : {-1, gpu::kGroupedGemmRegions}) {  // the checks pass but the region does not exist
    EXPECT_FALSE(gpu::launch_grouped_gemm(args, region, GroupedGemmConfig::kPingpong64x128x64, limits, buffer, nullptr)
                     .ok());
  }
}

}  // namespace
}  // namespace fulcrum::test
