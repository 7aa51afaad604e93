// CPU backend operations one by one, on inputs whose results are known exactly or by a direct formula.
#include <cmath>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "test_data.hpp"

namespace fulcrum::test {
namespace {

using model::Tensor;

class CpuOpsTest : public ::testing::Test {
 protected:
  Tensor make(std::vector<int64_t> shape, std::vector<float> values) {
    Tensor t = cpu.zeros(std::move(shape));
    cpu.upload(t, values);
    return t;
  }
  backend::CpuBackend cpu;
};

TEST_F(CpuOpsTest, MatmulIsXTimesWTransposed) {
  const Tensor x = make({2, 3}, {1, 2, 3, 4, 5, 6});         // [2, 3]
  const Tensor w = make({2, 3}, {1, 0, 0, 0, 1, 1});         // [2, 3]
  EXPECT_EQ(cpu.download(cpu.matmul(x, w)), (std::vector<float>{1, 5, 4, 11}));
  EXPECT_NE(error_of([&] { cpu.matmul(x, make({3, 2}, std::vector<float>(6))); }), "");
}

TEST_F(CpuOpsTest, RmsNormPerRow) {
  const Tensor x = make({2, 2}, {3, 4, 0, 0});
  const Tensor w = make({2}, {1, 2});
  const auto out = cpu.download(cpu.rms_norm(x, w, 0.0f));
  const float inv = 1.0f / std::sqrt(12.5f);
  EXPECT_FLOAT_EQ(out[0], 3 * inv);
  EXPECT_FLOAT_EQ(out[1], 2 * 4 * inv);
  const auto zero = cpu.download(cpu.rms_norm(x.rows(1, 1), w, 1e-6f));  // all-zero row stays zero
  EXPECT_EQ(zero, (std::vector<float>{0, 0}));
}

TEST_F(CpuOpsTest, RopeRotatesHalvesByPositionTimesInvFreq) {
  // One head of dim 4: pairs (0, 2) at inv_freq 1 and (1, 3) at inv_freq theta^-0.5 = 0.01.
  const Tensor x = make({2, 1, 4}, {1, 1, 0, 0, 1, 1, 0, 0});
  const std::vector<int32_t> positions = {0, 3};
  cpu.rope_inplace(x, positions, 1e4);
  const auto out = cpu.download(x);
  EXPECT_EQ(std::vector<float>(out.begin(), out.begin() + 4), (std::vector<float>{1, 1, 0, 0}));  // position 0
  EXPECT_NEAR(out[4], std::cos(3.0), 1e-6);
  EXPECT_NEAR(out[6], std::sin(3.0), 1e-6);
  EXPECT_NEAR(out[5], std::cos(0.03), 1e-6);
  EXPECT_NEAR(out[7], std::sin(0.03), 1e-6);
}

TEST_F(CpuOpsTest, CausalGroupedQueryAttention) {
  // 2 query heads share 1 kv head; 2 cached positions with values 10 and 20.
  const Tensor k_cache = make({2, 1, 2}, {0, 0, 0, 0});  // equal keys: uniform weights over visible keys
  const Tensor v_cache = make({2, 1, 2}, {10, 10, 20, 20});
  const Tensor q = make({2, 2, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  const auto out = cpu.download(cpu.attention(q, k_cache, v_cache, 0));  // [2, 4]
  EXPECT_EQ(std::vector<float>(out.begin(), out.begin() + 4), (std::vector<float>{10, 10, 10, 10}));  // sees key 0
  EXPECT_EQ(std::vector<float>(out.begin() + 4, out.end()), (std::vector<float>{15, 15, 15, 15}));  // keys 0, 1
  const auto decode = cpu.download(cpu.attention(q.rows(0, 1), k_cache, v_cache, 1));  // at position 1
  EXPECT_EQ(decode, (std::vector<float>{15, 15, 15, 15}));
}

TEST_F(CpuOpsTest, RouteTiesPickLowerIndexAndRenormalize) {
  const Tensor logits = make({1, 4}, {1, 2, 2, 0});  // experts 1 and 2 tie
  const model::RouterChoice one = cpu.route(logits, 1, true);
  EXPECT_EQ(one.expert_ids, (std::vector<int32_t>{1}));
  EXPECT_FLOAT_EQ(one.weights[0], 1.0f);
  const model::RouterChoice two = cpu.route(logits, 3, false);
  EXPECT_EQ(two.expert_ids, (std::vector<int32_t>{1, 2, 0}));
  const double denom = std::exp(1.0) + 2 * std::exp(2.0) + 1;
  EXPECT_NEAR(two.weights[0], std::exp(2.0) / denom, 1e-7);
  EXPECT_NEAR(two.weights[2], std::exp(1.0) / denom, 1e-7);
}

TEST_F(CpuOpsTest, SiluMulGatherScatterWeightedSum) {
  const Tensor gate_up = make({1, 4}, {0, 1, 5, 7});  // gate (0, 1), up (5, 7)
  const auto act = cpu.download(cpu.silu_mul(gate_up));
  EXPECT_FLOAT_EQ(act[0], 0.0f);
  EXPECT_FLOAT_EQ(act[1], 7.0f / (1.0f + std::exp(-1.0f)));

  const Tensor x = make({3, 2}, {1, 1, 2, 2, 3, 3});
  const std::vector<int32_t> rows = {2, 0};
  const Tensor gathered = cpu.gather_rows(x, rows);
  EXPECT_EQ(cpu.download(gathered), (std::vector<float>{3, 3, 1, 1}));
  const Tensor dst = cpu.zeros({3, 2});
  cpu.scatter_rows(dst, gathered, rows);
  EXPECT_EQ(cpu.download(dst), (std::vector<float>{1, 1, 0, 0, 3, 3}));
  const std::vector<float> weights = {0.5f, 2.0f, 1.0f, 0.0f};
  const Tensor sums = cpu.weighted_sum(make({4, 2}, {1, 2, 3, 4, 5, 6, 7, 8}), weights, 2);  // 2 tokens, k = 2
  EXPECT_EQ(cpu.download(sums), (std::vector<float>{6.5f, 9.0f, 5, 6}));
}

}  // namespace
}  // namespace fulcrum::test
