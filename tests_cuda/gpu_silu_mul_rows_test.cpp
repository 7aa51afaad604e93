// The CUTLASS expert path's activation between its two GEMMs (cuda::moe::launch_silu_mul_bf16_rows,
// src/gpu/moe/moe_kernels.hpp): rows [*row_begin, *row_end) of h [rows, 2I] (gate | up) into act [rows, I].
//  - the 16-byte path (I % 8 == 0, aligned pointers) against the scalar path on the same input: bitwise equal
//    (both evaluate the same fp32 expression per element); the scalar path is reached through an act pointer
//    2 bytes past a 16-byte boundary, and through I = 12;
//  - both against the CPU reference gpu::reference::swiglu_bf16: the GPU's expf may differ from glibc's by a
//    couple of ulp (CUDA documents at most 2), which moves the bf16 rounding only where the fp32 product lies
//    that close to a rounding midpoint; so each element must equal the bf16 of the reference's product scaled
//    by 1 - 2^-21, by 1 or by 1 + 2^-21 (8 ulp either way), and most must equal the reference exactly;
//  - rows outside the range and past max_rows keep their poison; an empty range writes nothing;
//  - shapes: the Qwen3-30B-A3B intermediate 768, the 235B-A22B 1536, a range starting past row 0, a range
//    longer than max_rows (cut), one row.
#include <cmath>
#include <cstring>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "gpu/reference/fp8_reference.hpp"
#include "moe_cuda_test_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;

constexpr uint16_t kPoison = 0x7fc1;  // a bf16 NaN no activation of finite inputs produces

struct Case {
  int cols;           // I
  int64_t rows;       // rows of h and act
  int32_t begin, end; // the range read on the device
  int64_t max_rows;   // the host bound
};

// act after one launch over a poisoned buffer; act_offset elements past the allocation's (aligned) start.
std::vector<uint16_t> run_silu(const DeviceBuffer& d_h, const DeviceBuffer& d_range, const Case& c, int act_offset) {
  DeviceBuffer d_act(sizeof(uint16_t) * (c.rows * c.cols + act_offset));
  const std::vector<uint16_t> poison(static_cast<size_t>(c.rows * c.cols + act_offset), kPoison);
  EXPECT_EQ(cudaMemcpy(d_act.as<uint16_t>(), poison.data(), sizeof(uint16_t) * poison.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  const int32_t* range = d_range.as<int32_t>();
  EXPECT_EQ(cuda::moe::launch_silu_mul_bf16_rows(d_h.as<uint16_t>(), range, range + 1, c.max_rows, c.cols,
                                                 d_act.as<uint16_t>() + act_offset, nullptr),
            cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> act = to_host(d_act.as<uint16_t>() + act_offset, c.rows * c.cols);
  return act;
}

class SiluMulRowsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(SiluMulRowsTest, VectorAndScalarPathsMatchEachOtherAndTheReference) {
  const Case cases[] = {
      {768, 40, 5, 37, 40},    // 30B intermediate, a range starting past row 0
      {1536, 24, 0, 24, 24},   // 235B intermediate, every row
      {768, 30, 3, 29, 11},    // max_rows cuts the range: rows [3, 14)
      {768, 4, 2, 3, 4},       // one row
      {12, 16, 1, 15, 16},     // I % 8 != 0: the scalar path only
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("I {} rows {} range [{}, {}) max_rows {}", c.cols, c.rows, c.begin, c.end, c.max_rows));
    // gate in [-8, 8) (exp over a wide range), up in [-2, 2).
    std::vector<float> h = random_bf16_values(c.rows * 2 * c.cols, 41 + c.cols, 8.0f);
    for (int64_t r = 0; r < c.rows; ++r) {
      for (int q = c.cols; q < 2 * c.cols; ++q) h[r * 2 * c.cols + q] = model::moe::round_bf16(h[r * 2 * c.cols + q] / 4.0f);
    }
    const std::vector<uint16_t> bits = to_bits(h);
    const std::vector<int32_t> range = {c.begin, c.end};
    const DeviceBuffer d_h = to_device(bits), d_range = to_device(range);

    const std::vector<uint16_t> fast = run_silu(d_h, d_range, c, 0);
    const std::vector<uint16_t> scalar = run_silu(d_h, d_range, c, 1);  // act 2 bytes off alignment
    EXPECT_EQ(std::memcmp(fast.data(), scalar.data(), sizeof(uint16_t) * fast.size()), 0)
        << "the 16-byte and scalar paths differ";

    const int64_t done_end = std::min<int64_t>(c.end, c.begin + c.max_rows);
    std::vector<uint16_t> ref(static_cast<size_t>(c.rows * c.cols), kPoison);
    const std::vector<int32_t> ref_offsets = {c.begin, static_cast<int32_t>(done_end)};
    gpu::reference::swiglu_bf16(bits, c.cols, ref_offsets, ref);

    int64_t outside = 0, exact = 0, inside = 0;
    for (int64_t r = 0; r < c.rows; ++r) {
      for (int q = 0; q < c.cols; ++q) {
        const size_t e = static_cast<size_t>(r * c.cols + q);
        if (r < c.begin || r >= done_end) {
          EXPECT_EQ(fast[e], kPoison) << "row " << r << " outside the range written";
          outside += fast[e] != kPoison;
          continue;
        }
        ++inside;
        exact += fast[e] == ref[e];
        const float gate = h[r * 2 * c.cols + q], up = h[r * 2 * c.cols + c.cols + q];
        const float v = gate / (1.0f + std::exp(-gate)) * up;  // as the reference computes it
        const bool allowed = fast[e] == ref[e] || fast[e] == model::f32_to_bf16_bits(v * (1.0f - 0x1p-21f)) ||
                             fast[e] == model::f32_to_bf16_bits(v * (1.0f + 0x1p-21f));
        EXPECT_TRUE(allowed) << "row " << r << " col " << q << ": " << fast[e] << " vs reference " << ref[e];
      }
    }
    EXPECT_EQ(outside, 0);
    EXPECT_EQ(inside, (done_end - c.begin) * c.cols);
    EXPECT_GE(exact, inside * 99 / 100) << "more than 1% of the activations off the reference";
  }
}

TEST_F(SiluMulRowsTest, EmptyRangeWritesNothing) {
  const Case c{768, 8, 5, 5, 8};
  const std::vector<uint16_t> bits = to_bits(random_bf16_values(c.rows * 2 * c.cols, 7, 1.0f));
  const std::vector<int32_t> range = {c.begin, c.end};
  const DeviceBuffer d_h = to_device(bits), d_range = to_device(range);
  for (const uint16_t v : run_silu(d_h, d_range, c, 0)) ASSERT_EQ(v, kPoison);
}

}  // namespace
}  // namespace fulcrum::test
