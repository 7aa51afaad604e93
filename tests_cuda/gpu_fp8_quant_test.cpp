// The 1x128 activation quantization kernels (src/gpu/kernels/fp8_quant.hpp) against their CPU references
// (gpu::reference::quantize_rows_fp8 / swiglu_quantize_fp8): groups of 0, 1 and many rows starting past row 0
// (rows outside every group before and after), a row of zeros (scale 0), blocks of extreme magnitudes and
// blocks whose every value quantizes to +-448, the Qwen3-30B-A3B widths (hidden 2048 for the gate_up input,
// intermediate 768 for the down input); one capture replayed with other device offsets; then the round trip:
// quantize on the GPU, FP8 grouped GEMM, against the GEMM of the unquantized bf16 activations.
//
// Tolerances and why:
//   exact      quantize_rows_fp8's q and scales (the kernel repeats the reference's fp32 operations: amax of
//              bf16 values, one IEEE division for 448 / amax and for amax / 448, one fp32 multiply, e4m3
//              round to nearest even with saturation, the same on both sides); untouched q bytes and scale
//              slots outside the groups
//   swiglu     the GPU's expf (CUDA: at most 2 ulp) and glibc's expf differ in the last bits, so the fp32
//              silu(g) * u may differ by a few ulp; its bf16 rounding then differs where that product lies
//              within those ulps of a bf16 rounding midpoint ("fragile": bf16 of the product scaled by
//              1 -+ 2^-21, i.e. 8 ulp either way, differ). So: scales within a relative 1e-6 of the
//              reference wherever the block's amax is not fragile, else within the amax range the fragile
//              values allow; q bitwise equal where neither the element nor the block's amax is fragile, else
//              within one e4m3 step (a perturbation of 2^-8 relative moves a value across at most one e4m3
//              rounding boundary: their spacing is >= 2^-4 relative)
//   round trip per element |gpu - ref_x| <= the GEMM bound (gpu_fp8_grouped_gemm_test.cpp) on the quantized
//              operands + sum_k |deq(q_k) sa - x_k| |w_k| (the exact quantization error, from the CPU
//              reference's q and scales, which equal the GPU's); ||gpu - ref_x|| / ||ref_x|| <= 2^-4: e4m3
//              rounds each activation with a relative error of at most 2^-4 (RMS about 2^-4 E[1/m] / sqrt(3)
//              = 0.026), independent across k, so the output's relative L2 error is about 0.026
#include <algorithm>
#include <cmath>
#include <cstring>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "fp8_test_util.hpp"
#include "gpu/kernels/fp8_quant.hpp"
#include "gpu/reference/fp8_reference.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using gpu::Fp8GroupedGemmConfig;

constexpr uint8_t kQPoison = 0xAA;

// Sign-magnitude e4m3 code -> an integer that counts e4m3 steps (+0 and -0 both 0).
int e4m3_ordinal(uint8_t code) { return (code & 0x80) ? -(code & 0x7f) : (code & 0x7f); }

// What one quantization run produced, with the scales read back as bits.
struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> scales;
};

class Fp8QuantTest : public Fp8GemmTest {
 protected:
  // Poisons q (0xAA) and scales (NaN), launches, returns both.
  Quantized run_quantize(bool swiglu, const DeviceBuffer& src, int cols, const DeviceBuffer& offsets, int num_groups,
                         int64_t rows, DeviceBuffer& q, DeviceBuffer& scales) {
    EXPECT_EQ(cudaMemsetAsync(q.as<void>(), kQPoison, q.bytes(), stream_), cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(scales.as<void>(), 0xff, scales.bytes(), stream_), cudaSuccess);
    const cudaError_t status =
        swiglu ? gpu::launch_swiglu_quantize_fp8(src.as<uint16_t>(), cols, offsets.as<int32_t>(), num_groups, rows,
                                                 q.as<uint8_t>(), scales.as<float>(), stream_)
               : gpu::launch_quantize_rows_fp8(src.as<uint16_t>(), cols, offsets.as<int32_t>(), num_groups, rows,
                                               q.as<uint8_t>(), scales.as<float>(), stream_);
    EXPECT_EQ(status, cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return {to_host(q.as<uint8_t>(), rows * cols), to_host(scales.as<float>(), rows * (cols / kFp8Block))};
  }
};

// CPU poisons as the GPU run's, then the reference.
Quantized reference_quantize(bool swiglu, const std::vector<uint16_t>& src, int cols, const std::vector<int32_t>& offsets,
                             int64_t rows) {
  Quantized r{std::vector<uint8_t>(static_cast<size_t>(rows * cols), kQPoison),
              std::vector<float>(static_cast<size_t>(rows * (cols / kFp8Block)))};
  uint32_t nan_bits = 0xffffffffu;
  for (float& s : r.scales) std::memcpy(&s, &nan_bits, sizeof(s));
  if (swiglu) {
    gpu::reference::swiglu_quantize_fp8(src, cols, offsets, r.q, r.scales);
  } else {
    gpu::reference::quantize_rows_fp8(src, cols, offsets, r.q, r.scales);
  }
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

// Groups of 0, 1, 0, 37, 200, 1, 5 rows from row 3; 2 rows after them.
const std::vector<int32_t> kCounts = {0, 1, 0, 37, 200, 1, 5};
constexpr int32_t kFirstRow = 3;

TEST_F(Fp8QuantTest, QuantizeRowsBitwiseEqualToReference) {
  const std::vector<int32_t> offsets = offsets_from(kCounts, kFirstRow);
  const int64_t rows = offsets.back() + 2;
  const int num_groups = static_cast<int>(kCounts.size());
  for (const int cols : {2048, 768}) {
    SCOPED_TRACE(fmt::format("cols {}", cols));
    std::vector<float> x = random_bf16_values(rows * cols, 7 + cols, 4.0f);
    const auto set_block = [&](int64_t row, int kb, auto value_of) {
      for (int c = 0; c < kFp8Block; ++c) x[row * cols + kb * kFp8Block + c] = model::moe::round_bf16(value_of(c));
    };
    const int64_t zero_row = offsets[3] + 5;  // in the 37-row group
    for (int c = 0; c < cols; ++c) x[zero_row * cols + c] = 0.0f;
    const int64_t odd_row = offsets[4] + 100;  // in the 200-row group
    set_block(odd_row, 0, [&](int c) { return (c % 2 ? -3.0e38f : 3.0e38f) * (1.0f - c / 512.0f); });  // near bf16 max
    set_block(odd_row, 1, [&](int c) { return 1.0e-30f * (1.0f + c / 64.0f) * (c % 3 ? 1.0f : -1.0f); });  // tiny
    set_block(odd_row, 2, [&](int c) { return c % 2 ? -3.0f : 3.0f; });  // every value +-amax: all +-448
    set_block(odd_row + 1, 3, [&](int c) { return c == 77 ? 1.0f : 0.0f; });  // one non-zero value
    const std::vector<uint16_t> bits = to_bits(x);
    const DeviceBuffer d_x = to_device(bits), d_offsets = to_device(offsets);
    DeviceBuffer d_q(static_cast<size_t>(rows * cols)), d_scales(sizeof(float) * rows * (cols / kFp8Block));
    const Quantized gpu = run_quantize(false, d_x, cols, d_offsets, num_groups, rows, d_q, d_scales);
    const Quantized ref = reference_quantize(false, bits, cols, offsets, rows);
    EXPECT_EQ(gpu.q, ref.q) << "q (poison 0xAA outside the groups included)";
    EXPECT_TRUE(same_bits(gpu.scales, ref.scales)) << "scales (NaN poison outside the groups included)";
    // The special rows came out as intended (checks the test's premise on the reference).
    const int k_blocks = cols / kFp8Block;
    const int64_t f3 = offsets[3], m3 = kCounts[3];
    for (int kb = 0; kb < k_blocks; ++kb) EXPECT_EQ(ref.scales[f3 * k_blocks + kb * m3 + (zero_row - f3)], 0.0f);
    const int64_t f4 = offsets[4], m4 = kCounts[4];
    for (int c = 0; c < kFp8Block; ++c) EXPECT_EQ(ref.q[odd_row * cols + 2 * kFp8Block + c] & 0x7f, 0x7e);
    EXPECT_GT(ref.scales[f4 * k_blocks + 0 * m4 + (odd_row - f4)], 1e35f);
    EXPECT_LT(ref.scales[f4 * k_blocks + 1 * m4 + (odd_row - f4)], 1e-30f);
  }
}

// One capture of the launch replayed with other offsets on the device (fixed max_rows): each replay equal
// to the reference of its offsets.
TEST_F(Fp8QuantTest, CapturedQuantizeReplaysWithNewOffsets) {
  const int cols = 768, groups = 7;
  const std::vector<std::vector<int32_t>> count_sets = {kCounts, {0, 0, 0, 0, 0, 0, 1}, {40, 40, 0, 40, 40, 40, 40}};
  const int64_t rows = 260;
  const std::vector<uint16_t> bits = to_bits(random_bf16_values(rows * cols, 17, 2.0f));
  const DeviceBuffer d_x = to_device(bits);
  DeviceBuffer d_offsets(sizeof(int32_t) * (groups + 1));
  DeviceBuffer d_q(static_cast<size_t>(rows * cols)), d_scales(sizeof(float) * rows * (cols / kFp8Block));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  const cudaError_t launched = gpu::launch_quantize_rows_fp8(d_x.as<uint16_t>(), cols, d_offsets.as<int32_t>(), groups,
                                                             rows, d_q.as<uint8_t>(), d_scales.as<float>(), stream_);
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  ASSERT_EQ(launched, cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (const auto& counts : count_sets) {
    const std::vector<int32_t> offsets = offsets_from(counts, 2);
    ASSERT_LE(offsets.back(), rows);
    ASSERT_EQ(cudaMemcpyAsync(d_offsets.as<int32_t>(), offsets.data(), sizeof(int32_t) * offsets.size(),
                              cudaMemcpyHostToDevice, stream_), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d_q.as<void>(), kQPoison, d_q.bytes(), stream_), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d_scales.as<void>(), 0xff, d_scales.bytes(), stream_), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const Quantized ref = reference_quantize(false, bits, cols, offsets, rows);
    EXPECT_EQ(to_host(d_q.as<uint8_t>(), rows * cols), ref.q) << "rows " << offsets.back();
    EXPECT_TRUE(same_bits(to_host(d_scales.as<float>(), rows * (cols / kFp8Block)), ref.scales)) << "rows " << offsets.back();
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(Fp8QuantTest, SwigluQuantizeWithinOneStepOfReference) {
  const std::vector<int32_t> offsets = offsets_from(kCounts, kFirstRow);
  const int64_t rows = offsets.back() + 2;
  const int num_groups = static_cast<int>(kCounts.size());
  const int cols = 768, k_blocks = cols / kFp8Block;
  // gate in [-8, 8) (exp over a wide range), up in [-2, 2).
  std::vector<float> h = random_bf16_values(rows * 2 * cols, 23, 8.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int c = cols; c < 2 * cols; ++c) h[r * 2 * cols + c] = model::moe::round_bf16(h[r * 2 * cols + c] / 4.0f);
  }
  const int64_t zero_row = offsets[4] + 9;
  for (int c = cols; c < 2 * cols; ++c) h[zero_row * 2 * cols + c] = 0.0f;  // up 0: activation 0, scale 0
  const std::vector<uint16_t> bits = to_bits(h);
  const DeviceBuffer d_h = to_device(bits), d_offsets = to_device(offsets);
  DeviceBuffer d_q(static_cast<size_t>(rows * cols)), d_scales(sizeof(float) * rows * k_blocks);
  const Quantized gpu = run_quantize(true, d_h, cols, d_offsets, num_groups, rows, d_q, d_scales);
  const Quantized ref = reference_quantize(true, bits, cols, offsets, rows);

  // bf16 activations the GPU may have seen: the reference's fp32 product perturbed by 8 ulp either way.
  const auto bf16_range = [&](int64_t r, int c) {
    const float gate = h[r * 2 * cols + c], up = h[r * 2 * cols + cols + c];
    const float v = gate / (1.0f + std::exp(-gate)) * up;  // as the reference computes it
    const float lo = std::abs(model::bf16_bits_to_f32(model::f32_to_bf16_bits(v * (1.0f - 0x1p-21f))));
    const float hi = std::abs(model::bf16_bits_to_f32(model::f32_to_bf16_bits(v * (1.0f + 0x1p-21f))));
    return std::pair<float, float>(std::min(lo, hi), std::max(lo, hi));
  };
  int64_t scale_bad = 0, q_bad = 0, fragile_blocks = 0, scales_differ = 0, q_differ = 0, scale_poison_lost = 0;
  for (size_t g = 0; g < kCounts.size(); ++g) {
    const int64_t first = offsets[g], m = kCounts[g];
    for (int64_t r = first; r < first + m; ++r) {
      for (int kb = 0; kb < k_blocks; ++kb) {
        const size_t s = static_cast<size_t>(first * k_blocks + kb * m + (r - first));
        float amax_lo = 0, amax_hi = 0;
        std::vector<bool> fragile(kFp8Block);
        for (int c = 0; c < kFp8Block; ++c) {
          const auto [lo, hi] = bf16_range(r, kb * kFp8Block + c);
          fragile[c] = lo != hi;
          amax_lo = std::max(amax_lo, lo);
          amax_hi = std::max(amax_hi, hi);
        }
        const bool amax_fragile = amax_lo != amax_hi;
        fragile_blocks += amax_fragile;
        const bool scale_same = std::memcmp(&gpu.scales[s], &ref.scales[s], sizeof(float)) == 0;
        scales_differ += !scale_same;
        if (!amax_fragile) {
          scale_bad += !(std::abs(gpu.scales[s] - ref.scales[s]) <= 1e-6f * ref.scales[s]);
        } else {
          scale_bad += !(gpu.scales[s] >= amax_lo / 448.0f * (1 - 1e-6f) && gpu.scales[s] <= amax_hi / 448.0f * (1 + 1e-6f));
        }
        for (int c = 0; c < kFp8Block; ++c) {
          const size_t e = static_cast<size_t>(r * cols + kb * kFp8Block + c);
          q_differ += gpu.q[e] != ref.q[e];
          if (scale_same && !amax_fragile && !fragile[c]) {
            q_bad += gpu.q[e] != ref.q[e];
          } else {
            q_bad += std::abs(e4m3_ordinal(gpu.q[e]) - e4m3_ordinal(ref.q[e])) > 1;
          }
        }
      }
    }
  }
  // Outside the groups: untouched.
  for (int64_t r = 0; r < rows; ++r) {
    if (r >= offsets.front() && r < offsets.back()) continue;
    for (int c = 0; c < cols; ++c) q_bad += gpu.q[r * cols + c] != kQPoison;
  }
  for (int64_t s = 0; s < rows * k_blocks; ++s) {
    if (s >= int64_t{offsets.front()} * k_blocks && s < int64_t{offsets.back()} * k_blocks) continue;
    scale_poison_lost += !std::isnan(gpu.scales[s]);
  }
  EXPECT_EQ(scale_bad, 0) << "scales outside their tolerance";
  EXPECT_EQ(q_bad, 0) << "q outside their tolerance (or written outside the groups)";
  EXPECT_EQ(scale_poison_lost, 0) << "scale slots outside the groups written";
  const int64_t zf = offsets[4], zm = kCounts[4];
  for (int kb = 0; kb < k_blocks; ++kb) EXPECT_EQ(gpu.scales[zf * k_blocks + kb * zm + (zero_row - zf)], 0.0f);
  fmt::print("  SwiGLU quantize: {} of {} blocks with a fragile amax, {} scales and {} of {} q differ from the reference\n",
             fragile_blocks, (offsets.back() - offsets.front()) * k_blocks, scales_differ, q_differ,
             (offsets.back() - offsets.front()) * int64_t{cols});
}

// x (bf16) -> GPU quantize -> FP8 grouped GEMM, against the GEMM of x itself with the dequantized weights.
TEST_F(Fp8QuantTest, RoundTripThroughTheGemm) {
  const int n = 512, k = 2048, k_blocks = k / kFp8Block;
  const std::vector<int32_t> counts = skewed_counts(128, 150, 3);
  const std::vector<int32_t> offsets = offsets_from(counts, kFirstRow);
  const int64_t rows = offsets.back() + 2;
  const int num_groups = static_cast<int>(counts.size());
  const std::vector<uint16_t> x = to_bits(random_bf16_values(rows * k, 29, 3.0f));
  const Fp8Weights w = make_fp8_weights(n, k, 8, 30);
  const DeviceBuffer d_x = to_device(x), d_offsets = to_device(offsets);
  DeviceBuffer d_q(static_cast<size_t>(rows * k)), d_scales(sizeof(float) * rows * k_blocks);
  DeviceBuffer d_out(sizeof(uint16_t) * rows * n);
  const Quantized gpu = run_quantize(false, d_x, k, d_offsets, num_groups, rows, d_q, d_scales);
  const Quantized ref = reference_quantize(false, x, k, offsets, rows);
  ASSERT_EQ(gpu.q, ref.q);
  ASSERT_TRUE(same_bits(gpu.scales, ref.scales));

  // The GEMM reference on the quantized operands, and the one on x itself (dequantized weights, double) with
  // the exact quantization error term sum_k |deq(q_k) sa - x_k| |w_k|.
  std::vector<float> ref_q(static_cast<size_t>(rows * n), NAN), abs_sum(ref_q.size(), 0.0f);
  gpu::reference::fp8_grouped_gemm(ref.q, ref.scales, offsets, w.b, w.b_scales, w.num_b, n, k, ref_q, abs_sum);
  std::vector<float> ref_x(ref_q.size(), NAN);
  std::vector<double> quant_err(ref_q.size(), 0.0);
  std::vector<double> xv(static_cast<size_t>(k)), dx(static_cast<size_t>(k));
  std::vector<double> w_deq(static_cast<size_t>(w.num_b) * n * k);  // [num_b, N, K] dequantized weights
  for (int b = 0; b < w.num_b; ++b) {
    for (int col = 0; col < n; ++col) {
      for (int q = 0; q < k; ++q) w_deq[(int64_t{b} * n + col) * k + q] = w.value(b, col, q);
    }
  }
  for (int g = 0; g < num_groups; ++g) {
    const int64_t first = offsets[g], m = counts[g];
    for (int64_t r = first; r < first + m; ++r) {
      for (int q = 0; q < k; ++q) {
        xv[q] = model::bf16_bits_to_f32(x[r * k + q]);
        const double sa = ref.scales[first * k_blocks + (q / kFp8Block) * m + (r - first)];
        dx[q] = std::abs(double(model::f8e4m3_to_f32(ref.q[r * k + q])) * sa - xv[q]);
      }
      for (int col = 0; col < n; ++col) {
        const double* w_row = w_deq.data() + (int64_t{g % w.num_b} * n + col) * k;
        double sum = 0, err = 0;
        for (int q = 0; q < k; ++q) {
          sum += xv[q] * w_row[q];
          err += dx[q] * std::abs(w_row[q]);
        }
        ref_x[r * n + col] = static_cast<float>(sum);
        quant_err[r * n + col] = err * (1 + 0x1p-8);  // (1 + 2^-8): the bf16 bound scales |ref_q| <= |ref_x| + err
      }
    }
  }
  for (const Fp8GroupedGemmConfig config : kFp8Configs) {
    SCOPED_TRACE(fp8_config_name(config));
    const std::vector<uint16_t> out =
        run_gemm(gemm_args(d_q.as<uint8_t>(), d_scales.as<float>(), d_offsets.as<int32_t>(), num_groups, w,
                           d_out.as<uint16_t>()),
                 config, rows);
    const auto vs_quantized = fp8_gemm_matches(out, ref_q, abs_sum);
    EXPECT_TRUE(vs_quantized) << "vs the reference on the quantized operands";
    const auto vs_x = fp8_gemm_matches(out, ref_x, abs_sum, quant_err, 0x1p-4);
    EXPECT_TRUE(vs_x) << "vs the GEMM of the unquantized activations";
    fmt::print("  FP8 round trip {}: vs quantized operands {}; vs bf16 activations {}\n", fp8_config_name(config),
               vs_quantized.message(), vs_x.message());
  }
}

TEST(Fp8QuantRules, LaunchersRefuseBadArguments) {
  // Host pointers stand in for device ones: every call below must fail before launching.
  alignas(16) static uint16_t x[256];
  alignas(16) static uint8_t q[256];
  alignas(16) static float scales[4];
  const int32_t offsets[2] = {0, 1};
  EXPECT_EQ(gpu::launch_quantize_rows_fp8(x, 100, offsets, 1, 1, q, scales, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::launch_quantize_rows_fp8(x, 0, offsets, 1, 1, q, scales, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::launch_quantize_rows_fp8(x, 128, offsets, 0, 1, q, scales, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::launch_quantize_rows_fp8(x, 128, offsets, 1, -1, q, scales, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::launch_quantize_rows_fp8(x + 1, 128, offsets, 1, 1, q, scales, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::launch_quantize_rows_fp8(x, 128, offsets, 1, 1, q + 8, scales, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::launch_quantize_rows_fp8(x, 128, nullptr, 1, 1, q, scales, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::launch_quantize_rows_fp8(x, 128, offsets, 1, 1, q, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::launch_swiglu_quantize_fp8(x, 192, offsets, 1, 1, q, scales, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::launch_swiglu_quantize_fp8(nullptr, 128, offsets, 1, 1, q, scales, nullptr), cudaErrorInvalidValue);
  // max_rows 0: nothing to launch.
  EXPECT_EQ(gpu::launch_quantize_rows_fp8(x, 128, offsets, 1, 0, q, scales, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace fulcrum::test
