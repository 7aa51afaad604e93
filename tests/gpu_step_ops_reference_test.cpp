// The GPU engine's step-op references (src/gpu/reference/step_ops_reference.hpp) are the fp32 model's own
// operations (CpuBackend embedding, add_inplace, rms_norm, rope_inplace, silu_mul) rounded to bf16 where the
// engine stores bf16: so the kernels checked against them (tests_cuda/gpu_step_ops_test.cpp) compute what the
// model computes. Exact comparisons: both sides run the same fp32 operations in the same order, compiled in ISO
// C++ mode (no FMA contraction), and the bf16 rounding is model::f32_to_bf16_bits on both.
#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "gpu/reference/step_ops_reference.hpp"
#include "model/backend.hpp"
#include "model/checkpoint_writer.hpp"

namespace fulcrum::test {
namespace {

using model::Tensor;
namespace ref = gpu::reference;

constexpr float kEps = 1e-6f;

std::vector<float> uniform(int64_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}
std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> bits(v.size());
  std::transform(v.begin(), v.end(), bits.begin(), model::f32_to_bf16_bits);
  return bits;
}
std::vector<float> widen(const std::vector<uint16_t>& bits) {
  std::vector<float> v(bits.size());
  std::transform(bits.begin(), bits.end(), v.begin(), model::bf16_bits_to_f32);
  return v;
}

class StepOpsReferenceTest : public ::testing::Test {
 protected:
  Tensor make(std::vector<int64_t> shape, const std::vector<float>& values) {
    Tensor t = cpu.zeros(std::move(shape));
    cpu.upload(t, values);
    return t;
  }
  backend::CpuBackend cpu;
};

TEST_F(StepOpsReferenceTest, EmbeddingIsTheModelsEmbeddingOfTheWidenedTable) {
  constexpr int kVocab = 50, kHidden = 24;
  const std::vector<uint16_t> table = to_bf16(uniform(kVocab * kHidden, 1, -1.0f, 1.0f));
  const std::vector<int32_t> ids = {3, 0, 49, 3, 17};
  std::vector<float> residual(ids.size() * kHidden);
  ref::embedding(table, ids, kHidden, residual);
  EXPECT_EQ(residual, cpu.download(cpu.embedding(make({kVocab, kHidden}, widen(table)), ids)));
}

// Gathered rows: the rows listed get the delta and are normed; the others stay as they were.
TEST_F(StepOpsReferenceTest, AddRmsNormIsTheModelsAddThenRmsNormRoundedToBf16) {
  constexpr int kTokens = 9, kHidden = 40;
  const std::vector<float> residual = uniform(kTokens * kHidden, 2, -3.0f, 3.0f);
  const std::vector<float> delta = uniform(kTokens * kHidden, 3, -1.0f, 1.0f);
  const std::vector<uint16_t> weight = to_bf16(uniform(kHidden, 4, 0.25f, 2.0f));
  const std::vector<int32_t> rows = {7, 2, 4, 0};
  for (const bool gathered : {false, true}) {
    SCOPED_TRACE(gathered ? "gathered" : "all rows");
    for (const bool with_delta : {false, true}) {
      SCOPED_TRACE(with_delta ? "delta" : "no delta");
      std::vector<int32_t> out_rows(kTokens);
      std::iota(out_rows.begin(), out_rows.end(), 0);
      if (gathered) out_rows = rows;
      std::vector<float> actual_residual = residual;
      std::vector<uint16_t> out(out_rows.size() * kHidden);
      ref::add_rms_norm(actual_residual, with_delta ? delta : std::vector<float>{}, weight, kEps,
                        gathered ? rows : std::vector<int32_t>{}, kHidden, out);

      const auto n = static_cast<int64_t>(out_rows.size());
      const Tensor x = cpu.gather_rows(make({kTokens, kHidden}, residual), out_rows);  // [n, H]
      if (with_delta) cpu.add_inplace(x, cpu.gather_rows(make({kTokens, kHidden}, delta), out_rows));
      EXPECT_EQ(out, to_bf16(cpu.download(cpu.rms_norm(x, make({kHidden}, widen(weight)), kEps))));
      const Tensor expected_residual = make({kTokens, kHidden}, residual);
      cpu.scatter_rows(expected_residual, x, out_rows);
      EXPECT_EQ(actual_residual, cpu.download(expected_residual)) << n << " rows";
    }
  }
}

// q and k: rms_norm over each head then rope_inplace, rounded; v rounded; a padding token (kv_rows -1) writes
// its q and leaves both pools as they were.
TEST_F(StepOpsReferenceTest, QkNormRopeIsTheModelsNormThenRopeRoundedToBf16) {
  constexpr int kTokens = 5, kHeads = 4, kKvHeads = 2, kHeadDim = 16;
  constexpr int kWidth = (kHeads + 2 * kKvHeads) * kHeadDim, kPoolRows = 8;
  constexpr double kTheta = 1e6;
  constexpr uint16_t kOld = 0x3f80;  // 1.0: the pools' old contents
  const std::vector<float> qkv = uniform(kTokens * kWidth, 5, -2.0f, 2.0f);
  const std::vector<uint16_t> q_norm = to_bf16(uniform(kHeadDim, 6, 0.25f, 2.0f));
  const std::vector<uint16_t> k_norm = to_bf16(uniform(kHeadDim, 7, 0.25f, 2.0f));
  const std::vector<int32_t> positions = {0, 1, 39999, 7, 40000};
  const std::vector<int32_t> kv_rows = {6, 1, -1, 3, 0};
  std::vector<uint16_t> q_out(kTokens * kHeads * kHeadDim);
  std::vector<uint16_t> k_pool(kPoolRows * kKvHeads * kHeadDim, kOld), v_pool = k_pool;
  ref::qk_norm_rope_kv_append(qkv, q_norm, k_norm, kEps, positions, model::rope_inv_freq(kHeadDim, kTheta), kv_rows,
                              kHeads, kKvHeads, kHeadDim, q_out, k_pool, v_pool);

  // The model's path: heads [first, first + count) of every token as [T, count, D], normed, rotated.
  const auto heads = [&](int first, int count) {
    std::vector<float> values;
    for (int t = 0; t < kTokens; ++t) {
      const auto begin = qkv.begin() + t * kWidth + first * kHeadDim;
      values.insert(values.end(), begin, begin + count * kHeadDim);
    }
    return make({kTokens, count, kHeadDim}, values);
  };
  const Tensor q = cpu.rms_norm(heads(0, kHeads), make({kHeadDim}, widen(q_norm)), kEps);
  cpu.rope_inplace(q, positions, kTheta);
  EXPECT_EQ(q_out, to_bf16(cpu.download(q)));
  const Tensor k = cpu.rms_norm(heads(kHeads, kKvHeads), make({kHeadDim}, widen(k_norm)), kEps);
  cpu.rope_inplace(k, positions, kTheta);
  const std::vector<uint16_t> k_rows = to_bf16(cpu.download(k)),
                              v_rows = to_bf16(cpu.download(heads(kHeads + kKvHeads, kKvHeads)));

  std::vector<uint16_t> k_expected(k_pool.size(), kOld), v_expected = k_expected;
  constexpr int kRowValues = kKvHeads * kHeadDim;
  for (int t = 0; t < kTokens; ++t) {
    if (kv_rows[t] < 0) continue;
    std::copy_n(k_rows.begin() + t * kRowValues, kRowValues, k_expected.begin() + kv_rows[t] * kRowValues);
    std::copy_n(v_rows.begin() + t * kRowValues, kRowValues, v_expected.begin() + kv_rows[t] * kRowValues);
  }
  EXPECT_EQ(k_pool, k_expected);
  EXPECT_EQ(v_pool, v_expected);
}

TEST_F(StepOpsReferenceTest, SiluMulIsTheModelsSiluMulRoundedToBf16) {
  constexpr int kRows = 6, kWidth = 20;
  const std::vector<float> gate_up = uniform(kRows * 2 * kWidth, 8, -8.0f, 8.0f);
  std::vector<uint16_t> act(kRows * kWidth);
  ref::silu_mul(gate_up, kRows, kWidth, act);
  EXPECT_EQ(act, to_bf16(cpu.download(cpu.silu_mul(make({kRows, 2 * kWidth}, gate_up)))));
}

}  // namespace
}  // namespace fulcrum::test
