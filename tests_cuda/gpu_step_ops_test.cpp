// The GPU engine's per-token kernels (src/gpu/kernels/step_ops.cu) against their CPU references
// (src/gpu/reference/step_ops_reference.hpp) on fresh random inputs: hidden 64 / 2048 / 4096 (and 50, 8200 and a
// misaligned pointer for the scalar paths), 1 / 7 / 33 / 1000 tokens, heads 4/2, 32/4, 64/4 with head_dim 16 to
// 256, positions up to 40000, KV rows scattered over the pool with padding tokens (kv_rows -1) among them, row
// lists identity and gathered. Outputs are poisoned (bf16 NaN, fp32 NaN) before each run so an unwritten value
// fails; pool rows no token targets, and a guard row just before the pool (where a kv_row of -1 would land), must
// keep their old contents bit for bit. Then the four kernels captured in one CUDA graph and replayed with new
// token ids, positions and KV rows written to device memory between replays.
//
// Tolerances and why:
//   exact        embedding (bf16 -> fp32 widening), the fp32 residual after the add (one fp32 add per value on
//                both sides), V rows (bf16 of the raw values), pool rows not targeted and the guard row.
//   1 bf16 step  add_rms_norm, q / k, silu_mul (as bf16 bit patterns ordered as integers, so adjacent values are
//                one step apart): both sides round the same fp32 expression to bf16, and the fp32 values differ by
//                a few fp32 ulps at most -- the double sums of squares are added in another order (their fp32
//                mean can differ by one ulp, rarely), and the device's cosf / sinf / expf are within 2 ulp where
//                glibc's are within 1 -- which can flip one bf16 rounding.
//   q / k also   |gpu - ref| <= one bf16 step above |ref| + 2^-20 max(|ref_i|, |ref_partner|) (partner: the value
//                rotated with it, i +- D/2): a cos - b sin cancels when the result is small, so a cos / sin
//                difference of 3 fp32 ulps (2^-22.4 of |a| + |b|) can be many bf16 steps of the small result;
//                |a| + |b| <= 2 max(|ref_i|, |ref_partner|) since a rotation keeps a^2 + b^2.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "cuda_test_util.hpp"
#include "gpu/kernels/step_ops.hpp"
#include "gpu/reference/step_ops_reference.hpp"
#include "model/backend.hpp"
#include "model/checkpoint_writer.hpp"
#include "model/moe_reference.hpp"
#include "moe_cuda_test_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
namespace ref = gpu::reference;

constexpr uint16_t kPoisonBf16 = 0xffff;  // a NaN
constexpr float kRotationSlack = 0x1p-20f;
constexpr float kEps = 1e-6f;
constexpr double kRopeTheta = 1e6;  // Qwen3's

class StepOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the step op tests need a GPU";
  }
};

std::vector<uint16_t> random_bf16(int64_t n, uint32_t seed, float lo, float hi) {
  return to_bits(random_values(n, seed, lo, hi));
}

// A device copy of `host`; with `misaligned`, one element of padding in front, so that the pointer (`ptr`) is
// 2 or 4 bytes past a 16-byte boundary and the launchers take their scalar paths.
template <typename T>
struct DeviceArray {
  DeviceBuffer buffer;
  T* ptr = nullptr;
};
template <typename T>
DeviceArray<T> device_array(const std::vector<T>& host, bool misaligned = false) {
  std::vector<T> padded(misaligned ? 1 : 0, T{});
  padded.insert(padded.end(), host.begin(), host.end());
  DeviceArray<T> array{to_device(padded)};
  array.ptr = array.buffer.template as<T>() + (misaligned ? 1 : 0);
  return array;
}

int bf16_steps(uint16_t a, uint16_t b) {
  const auto ordered = [](uint16_t v) { return (v & 0x8000u) ? -static_cast<int>(v & 0x7fffu) : static_cast<int>(v); };
  return std::abs(ordered(a) - ordered(b));
}
float bf16_spacing_above(float magnitude) {
  const uint16_t bits = model::f32_to_bf16_bits(magnitude);
  return model::bf16_bits_to_f32(static_cast<uint16_t>(bits + 1)) - model::bf16_bits_to_f32(bits);
}

// Every value within one bf16 step of the reference, or within slack[i] (absolute, empty: none) plus one step.
::testing::AssertionResult within_one_bf16_step(const std::vector<uint16_t>& actual,
                                                const std::vector<uint16_t>& expected,
                                                const std::vector<float>& slack = {}) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << actual.size() << " values, expected " << expected.size();
  }
  int64_t one_step = 0, by_slack = 0, bad = 0;
  size_t first_bad = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const int steps = bf16_steps(actual[i], expected[i]);
    if (steps == 0) continue;
    const float a = model::bf16_bits_to_f32(actual[i]), e = model::bf16_bits_to_f32(expected[i]);
    if (std::isfinite(a) && steps == 1) {
      ++one_step;
    } else if (std::isfinite(a) && !slack.empty() && std::abs(a - e) <= slack[i] + bf16_spacing_above(std::abs(e))) {
      ++by_slack;
    } else if (bad++ == 0) {
      first_bad = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << actual.size() << " values off by more than allowed ("
                                       << one_step << " one step off, " << by_slack
                                       << " within the rotation slack); first at " << first_bad << ": "
                                       << model::bf16_bits_to_f32(actual[first_bad]) << " vs "
                                       << model::bf16_bits_to_f32(expected[first_bad]);
}

::testing::AssertionResult bits_equal(const std::vector<uint16_t>& actual, const std::vector<uint16_t>& expected) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << actual.size() << " values, expected " << expected.size();
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    if (actual[i] != expected[i]) {
      return ::testing::AssertionFailure() << "value " << i << ": bits " << actual[i] << ", expected " << expected[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// The q / k slack of each value (see the top): 2^-20 of the larger magnitude of it and its rotation partner.
std::vector<float> rotation_slack(const std::vector<uint16_t>& expected, int head_dim) {
  const size_t d = static_cast<size_t>(head_dim), half = d / 2;
  std::vector<float> slack(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const size_t j = i % d, partner = i - j + (j < half ? j + half : j - half);
    slack[i] = kRotationSlack * std::max(std::abs(model::bf16_bits_to_f32(expected[i])),
                                         std::abs(model::bf16_bits_to_f32(expected[partner])));
  }
  return slack;
}

// Rows [row_values each] of a pool split into those a token targets and the rest, in row order.
struct PoolRows {
  std::vector<uint16_t> targeted, untouched;
};
PoolRows split_rows(const std::vector<uint16_t>& pool, int64_t row_values, const std::vector<bool>& is_target) {
  PoolRows out;
  for (size_t r = 0; r < is_target.size(); ++r) {
    auto& dst = is_target[r] ? out.targeted : out.untouched;
    dst.insert(dst.end(), pool.begin() + r * row_values, pool.begin() + (r + 1) * row_values);
  }
  return out;
}

// ---- embedding

TEST_F(StepOpsTest, EmbeddingMatchesReference) {
  constexpr int kVocab = 1000;
  struct Case {
    int hidden;
    int64_t tokens;
    bool misaligned;
  };
  std::vector<Case> cases;
  for (const int hidden : {64, 2048, 4096}) {
    for (const int64_t tokens : {1, 7, 33, 1000}) cases.push_back({hidden, tokens, false});
  }
  cases.push_back({50, 33, false});
  cases.push_back({2048, 7, true});
  uint32_t seed = 100;
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("H{} T{}{}", c.hidden, c.tokens, c.misaligned ? " misaligned" : ""));
    const std::vector<uint16_t> table = random_bf16(int64_t{kVocab} * c.hidden, ++seed, -1.0f, 1.0f);
    std::mt19937 rng(++seed);
    std::vector<int32_t> ids(static_cast<size_t>(c.tokens));
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % kVocab);
    ids[0] = kVocab - 1;  // the table's last row
    std::vector<float> expected(ids.size() * c.hidden);
    ref::embedding(table, ids, c.hidden, expected);

    const auto d_table = device_array(table, c.misaligned);
    const auto d_ids = device_array(ids);
    auto d_residual = device_array(std::vector<float>(expected.size(), NAN), c.misaligned);
    ASSERT_EQ(gpu::launch_embedding(d_table.ptr, d_ids.ptr, c.tokens, c.hidden, d_residual.ptr, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(bitwise_equal(to_host(d_residual.ptr, static_cast<int64_t>(expected.size())), expected));
  }
}

// ---- add + RMSNorm

TEST_F(StepOpsTest, AddRmsNormMatchesReference) {
  struct Case {
    int hidden;
    int64_t tokens;
    bool gathered, with_delta, misaligned;
  };
  std::vector<Case> cases;
  for (const int hidden : {64, 2048, 4096}) {
    for (const int64_t tokens : {1, 7, 33, 1000}) {
      for (const bool gathered : {false, true}) {
        for (const bool with_delta : {false, true}) cases.push_back({hidden, tokens, gathered, with_delta, false});
      }
    }
  }
  cases.push_back({50, 33, true, true, false});     // hidden % 8 != 0: scalar path
  cases.push_back({8192, 33, false, true, false});  // the vector path's largest row (1024 threads)
  cases.push_back({8200, 7, true, true, false});    // above it: scalar path
  cases.push_back({2048, 7, true, true, true});     // misaligned pointers: scalar path
  uint32_t seed = 200;
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("H{} T{}{}{}{}", c.hidden, c.tokens, c.gathered ? " gathered" : "",
                             c.with_delta ? " delta" : "", c.misaligned ? " misaligned" : ""));
    const int64_t n = c.tokens * c.hidden;
    const std::vector<float> residual = random_values(n, ++seed, -3.0f, 3.0f);
    const std::vector<float> delta = c.with_delta ? random_values(n, ++seed, -1.0f, 1.0f) : std::vector<float>{};
    const std::vector<uint16_t> weight = random_bf16(c.hidden, ++seed, 0.25f, 2.0f);
    std::vector<int32_t> rows;
    if (c.gathered) {  // about half the rows, shuffled (e.g. the last token of each sequence)
      rows.resize(static_cast<size_t>(c.tokens));
      std::iota(rows.begin(), rows.end(), 0);
      std::shuffle(rows.begin(), rows.end(), std::mt19937(++seed));
      rows.resize(static_cast<size_t>((c.tokens + 1) / 2));
    }
    const int64_t num_out = c.gathered ? static_cast<int64_t>(rows.size()) : c.tokens;
    std::vector<float> expected_residual = residual;
    std::vector<uint16_t> expected_out(static_cast<size_t>(num_out * c.hidden));
    ref::add_rms_norm(expected_residual, delta, weight, kEps, rows, c.hidden, expected_out);

    auto d_residual = device_array(residual, c.misaligned);
    const auto d_delta = device_array(delta, c.misaligned);
    const auto d_weight = device_array(weight);
    const auto d_rows = device_array(rows);
    auto d_out = device_array(std::vector<uint16_t>(expected_out.size(), kPoisonBf16), c.misaligned);
    ASSERT_EQ(gpu::launch_add_rms_norm(d_residual.ptr, c.with_delta ? d_delta.ptr : nullptr, d_weight.ptr, kEps,
                                       c.gathered ? d_rows.ptr : nullptr, num_out, c.hidden, d_out.ptr, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(bitwise_equal(to_host(d_residual.ptr, n), expected_residual));  // rows outside `rows` untouched too
    EXPECT_TRUE(within_one_bf16_step(to_host(d_out.ptr, static_cast<int64_t>(expected_out.size())), expected_out));
  }
}

// The MoE combine fused into add + RMSNorm against combine_reference then add_rms_norm: the residual within
// 2^-20 x (8 + k) absolute (values up to ~11; the kernel sums the k products with FMAs, the reference rounds each
// product: a few fp32 ulps), the normed output within 2^-8 of itself plus 2^-13 of its row's largest |value|:
// one bf16 step where the residual is large, and where residual and delta nearly cancel (seen: 3.3e-6 in a row
// reaching ~1) an absolute slack scaled from the residual's few-ulp difference (|dx| / rms ~ 1e-5 of the row).
TEST_F(StepOpsTest, MoeCombineAddRmsNormMatchesReference) {
  uint32_t seed = 900;
  for (const int hidden : {64, 2048, 4096}) {
    for (const int64_t tokens : {1, 7, 33}) {
      for (const int top_k : {1, 8}) {
        for (const bool gathered : {false, true}) {
          SCOPED_TRACE(fmt::format("H{} T{} k{}{}", hidden, tokens, top_k, gathered ? " gathered" : ""));
          const int64_t n = tokens * hidden, entries = tokens * top_k;
          const std::vector<float> residual = random_values(n, ++seed, -3.0f, 3.0f);
          const std::vector<uint16_t> expert_rows = random_bf16(entries * hidden, ++seed, -1.0f, 1.0f);
          const std::vector<float> weights = random_values(entries, ++seed, 0.0f, 1.0f);
          std::vector<int32_t> entry_row(static_cast<size_t>(entries));
          std::iota(entry_row.begin(), entry_row.end(), 0);
          std::shuffle(entry_row.begin(), entry_row.end(), std::mt19937(++seed));
          const std::vector<uint16_t> weight = random_bf16(hidden, ++seed, 0.25f, 2.0f);
          std::vector<int32_t> rows;
          if (gathered) {
            rows.resize(static_cast<size_t>(tokens));
            std::iota(rows.begin(), rows.end(), 0);
            std::shuffle(rows.begin(), rows.end(), std::mt19937(++seed));
            rows.resize(static_cast<size_t>((tokens + 1) / 2));
          }
          const int64_t num_out = gathered ? static_cast<int64_t>(rows.size()) : tokens;
          const std::vector<float> delta =
              model::moe::combine_reference(to_floats(expert_rows), entry_row, weights, tokens, top_k, hidden);
          std::vector<float> expected_residual = residual;
          std::vector<uint16_t> expected_out(static_cast<size_t>(num_out * hidden));
          // Gathered: only the listed rows take the delta, as the kernel does.
          ref::add_rms_norm(expected_residual, delta, weight, kEps, rows, hidden, expected_out);

          auto d_residual = device_array(residual);
          const auto d_rows_bits = device_array(expert_rows);
          const auto d_entry_row = device_array(entry_row);
          const auto d_weights = device_array(weights);
          const auto d_weight = device_array(weight);
          const auto d_rows = device_array(rows);
          auto d_out = device_array(std::vector<uint16_t>(expected_out.size(), kPoisonBf16));
          gpu::MoeCombineDelta moe;
          moe.expert_rows = d_rows_bits.ptr;
          moe.entry_row = d_entry_row.ptr;
          moe.weights = d_weights.ptr;
          moe.top_k = top_k;
          ASSERT_EQ(gpu::launch_moe_combine_add_rms_norm(d_residual.ptr, moe, d_weight.ptr, kEps,
                                                         gathered ? d_rows.ptr : nullptr, num_out, hidden, d_out.ptr,
                                                         nullptr),
                    cudaSuccess);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          const std::vector<float> got = to_host(d_residual.ptr, n);
          double worst = 0;
          for (size_t q = 0; q < got.size(); ++q) worst = std::max(worst, std::abs(double(got[q]) - expected_residual[q]));
          EXPECT_LE(worst, std::ldexp(8.0 + top_k, -20)) << "residual |difference|";
          const std::vector<float> out_got = to_floats(to_host(d_out.ptr, static_cast<int64_t>(expected_out.size())));
          const std::vector<float> out_ref = to_floats(expected_out);
          int64_t off = 0;
          for (int64_t i = 0; i < num_out; ++i) {
            float row_max = 0;
            for (int c = 0; c < hidden; ++c) row_max = std::max(row_max, std::abs(out_ref[i * hidden + c]));
            for (int c = 0; c < hidden; ++c) {
              const float g = out_got[i * hidden + c], r = out_ref[i * hidden + c];
              off += !(std::abs(g - r) <= std::ldexp(std::abs(r), -8) + std::ldexp(row_max, -13));
            }
          }
          EXPECT_EQ(off, 0) << "normed values outside the bound";
        }
      }
    }
  }
  gpu::MoeCombineDelta none;
  EXPECT_EQ(gpu::launch_moe_combine_add_rms_norm(nullptr, none, nullptr, kEps, nullptr, 1, 64, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_FALSE(gpu::moe_combine_add_rms_norm_supported(50));
}

// ---- q/k norm + RoPE + KV append

struct QkCase {
  int num_heads, num_kv_heads, head_dim;
  int64_t tokens;
  bool all_padding = false;
};

// Random inputs of one prologue call and the reference's outputs; pools are [pool_rows, Hkv, D].
struct QkProblem {
  QkCase shape;
  int64_t pool_rows = 0, kv_row_values = 0;
  std::vector<float> qkv, inv_freq;
  std::vector<uint16_t> q_norm, k_norm, k_pool_before, v_pool_before, guard_row;
  std::vector<int32_t> positions, kv_rows;
  std::vector<bool> is_target;  // [pool_rows]: some token writes the row
  std::vector<uint16_t> q_expected, k_expected, v_expected;
};

QkProblem make_qk_problem(const QkCase& c, uint32_t seed) {
  QkProblem p;
  p.shape = c;
  const int64_t width = int64_t{c.num_heads + 2 * c.num_kv_heads} * c.head_dim;
  p.kv_row_values = int64_t{c.num_kv_heads} * c.head_dim;
  p.pool_rows = 2 * c.tokens + 3;
  p.qkv = random_values(c.tokens * width, seed, -2.0f, 2.0f);
  p.q_norm = random_bf16(c.head_dim, seed + 1, 0.25f, 2.0f);
  p.k_norm = random_bf16(c.head_dim, seed + 2, 0.25f, 2.0f);
  p.inv_freq = model::rope_inv_freq(c.head_dim, kRopeTheta);
  std::mt19937 rng(seed + 3);
  p.positions.resize(static_cast<size_t>(c.tokens));
  for (int32_t& pos : p.positions) pos = static_cast<int32_t>(rng() % 40001);
  p.positions[0] = 40000;
  if (c.tokens > 1) p.positions[1] = 0;
  // Distinct pool rows in random order; every fourth token from the third on is padding.
  std::vector<int32_t> rows(static_cast<size_t>(p.pool_rows));
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  p.kv_rows.assign(rows.begin(), rows.begin() + c.tokens);
  p.is_target.assign(static_cast<size_t>(p.pool_rows), false);
  for (int64_t t = 0; t < c.tokens; ++t) {
    if (c.all_padding || t % 4 == 2)
      p.kv_rows[t] = -1;
    else
      p.is_target[p.kv_rows[t]] = true;
  }
  // Old pool contents; targeted rows poisoned (an unwritten value fails the comparison).
  p.k_pool_before = random_bf16(p.pool_rows * p.kv_row_values, seed + 4, -1.0f, 1.0f);
  p.v_pool_before = random_bf16(p.pool_rows * p.kv_row_values, seed + 5, -1.0f, 1.0f);
  for (int64_t r = 0; r < p.pool_rows; ++r) {
    if (!p.is_target[r]) continue;
    std::fill_n(p.k_pool_before.begin() + r * p.kv_row_values, p.kv_row_values, kPoisonBf16);
    std::fill_n(p.v_pool_before.begin() + r * p.kv_row_values, p.kv_row_values, kPoisonBf16);
  }
  p.guard_row = random_bf16(p.kv_row_values, seed + 6, -1.0f, 1.0f);

  p.q_expected.resize(static_cast<size_t>(c.tokens * c.num_heads * c.head_dim));
  p.k_expected = p.k_pool_before;
  p.v_expected = p.v_pool_before;
  ref::qk_norm_rope_kv_append(p.qkv, p.q_norm, p.k_norm, kEps, p.positions, p.inv_freq, p.kv_rows, c.num_heads,
                              c.num_kv_heads, c.head_dim, p.q_expected, p.k_expected, p.v_expected);
  return p;
}

// A pool on the device with the guard row in front: `ptr` is row 0, row -1 is the guard.
DeviceArray<uint16_t> device_pool(const std::vector<uint16_t>& guard_row, const std::vector<uint16_t>& pool) {
  std::vector<uint16_t> with_guard = guard_row;
  with_guard.insert(with_guard.end(), pool.begin(), pool.end());
  DeviceArray<uint16_t> array{to_device(with_guard)};
  array.ptr = array.buffer.as<uint16_t>() + guard_row.size();
  return array;
}

// The kernel's q_out and pools (guard row first) against the problem's reference.
void expect_qk_outputs(const QkProblem& p, const std::vector<uint16_t>& q_out,
                       const std::vector<uint16_t>& k_with_guard, const std::vector<uint16_t>& v_with_guard) {
  const int64_t g = p.kv_row_values;
  EXPECT_TRUE(within_one_bf16_step(q_out, p.q_expected, rotation_slack(p.q_expected, p.shape.head_dim))) << "q";
  EXPECT_TRUE(bits_equal({k_with_guard.begin(), k_with_guard.begin() + g}, p.guard_row)) << "k guard row";
  EXPECT_TRUE(bits_equal({v_with_guard.begin(), v_with_guard.begin() + g}, p.guard_row)) << "v guard row";
  const PoolRows k = split_rows({k_with_guard.begin() + g, k_with_guard.end()}, g, p.is_target);
  const PoolRows k_ref = split_rows(p.k_expected, g, p.is_target);
  EXPECT_TRUE(within_one_bf16_step(k.targeted, k_ref.targeted, rotation_slack(k_ref.targeted, p.shape.head_dim)))
      << "k";
  EXPECT_TRUE(bits_equal(k.untouched, k_ref.untouched)) << "k rows no token targets";
  EXPECT_TRUE(bits_equal({v_with_guard.begin() + g, v_with_guard.end()}, p.v_expected)) << "v";
}

TEST_F(StepOpsTest, QkNormRopeKvAppendMatchesReference) {
  const std::vector<QkCase> cases = {{4, 2, 16, 7},      {4, 2, 16, 33},     {4, 2, 32, 7},     {4, 2, 64, 1},
                                     {4, 2, 64, 33},     {32, 4, 128, 1},    {32, 4, 128, 33},  {64, 4, 128, 1},
                                     {64, 4, 128, 7},    {64, 4, 128, 1000}, {32, 4, 64, 1000}, {8, 2, 256, 7},
                                     {4, 2, 64, 3, true}};
  uint32_t seed = 300;
  for (const QkCase& c : cases) {
    SCOPED_TRACE(fmt::format("Hq{} Hkv{} D{} T{}{}", c.num_heads, c.num_kv_heads, c.head_dim, c.tokens,
                             c.all_padding ? " all padding" : ""));
    seed += 10;
    const QkProblem p = make_qk_problem(c, seed);
    const auto d_qkv = device_array(p.qkv);
    const auto d_q_norm = device_array(p.q_norm);
    const auto d_k_norm = device_array(p.k_norm);
    const auto d_positions = device_array(p.positions);
    const auto d_inv_freq = device_array(p.inv_freq);
    const auto d_kv_rows = device_array(p.kv_rows);
    auto d_q_out = device_array(std::vector<uint16_t>(p.q_expected.size(), kPoisonBf16));
    auto d_k_pool = device_pool(p.guard_row, p.k_pool_before);
    auto d_v_pool = device_pool(p.guard_row, p.v_pool_before);
    ASSERT_EQ(gpu::launch_qk_norm_rope_kv_append(d_qkv.ptr, d_q_norm.ptr, d_k_norm.ptr, kEps, d_positions.ptr,
                                                 d_inv_freq.ptr, d_kv_rows.ptr, c.tokens, c.num_heads, c.num_kv_heads,
                                                 c.head_dim, d_q_out.ptr, d_k_pool.ptr, d_v_pool.ptr, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const int64_t pool_values = (p.pool_rows + 1) * p.kv_row_values;
    expect_qk_outputs(p, to_host(d_q_out.ptr, static_cast<int64_t>(p.q_expected.size())),
                      to_host(d_k_pool.buffer.as<uint16_t>(), pool_values),
                      to_host(d_v_pool.buffer.as<uint16_t>(), pool_values));
  }
}

// ---- SwiGLU

TEST_F(StepOpsTest, SiluMulMatchesReference) {
  struct Case {
    int width;
    int64_t tokens;
    bool misaligned;
  };
  std::vector<Case> cases;
  for (const int width : {64, 768, 1536}) {
    for (const int64_t tokens : {1, 7, 33, 1000}) cases.push_back({width, tokens, false});
  }
  cases.push_back({22, 33, false});  // width % 4 != 0: scalar path
  cases.push_back({768, 7, true});
  uint32_t seed = 400;
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("I{} T{}{}", c.width, c.tokens, c.misaligned ? " misaligned" : ""));
    const std::vector<float> gate_up = random_values(c.tokens * 2 * c.width, ++seed, -8.0f, 8.0f);
    std::vector<uint16_t> expected(static_cast<size_t>(c.tokens * c.width));
    ref::silu_mul(gate_up, c.tokens, c.width, expected);

    const auto d_gate_up = device_array(gate_up, c.misaligned);
    auto d_act = device_array(std::vector<uint16_t>(expected.size(), kPoisonBf16), c.misaligned);
    ASSERT_EQ(gpu::launch_silu_mul(d_gate_up.ptr, c.tokens, c.width, d_act.ptr, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(within_one_bf16_step(to_host(d_act.ptr, static_cast<int64_t>(expected.size())), expected));
  }
}

// ---- launch contracts

TEST_F(StepOpsTest, ZeroTokensLaunchNothingAndBadHeadDimIsRefused) {
  EXPECT_EQ(gpu::launch_embedding(nullptr, nullptr, 0, 2048, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(gpu::launch_add_rms_norm(nullptr, nullptr, nullptr, kEps, nullptr, 0, 2048, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(gpu::launch_qk_norm_rope_kv_append(nullptr, nullptr, nullptr, kEps, nullptr, nullptr, nullptr, 0, 32, 4,
                                               128, nullptr, nullptr, nullptr, nullptr),
            cudaSuccess);
  EXPECT_EQ(gpu::launch_silu_mul(nullptr, 0, 768, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(gpu::launch_qk_norm_rope_kv_append(nullptr, nullptr, nullptr, kEps, nullptr, nullptr, nullptr, 1, 32, 4, 96,
                                               nullptr, nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // a refusal launches nothing and leaves no sticky error
}

// The four kernels in one CUDA graph (a tiny model's shapes: V 512, H 256, heads 4/2, D 64, I 96, 7 tokens),
// replayed twice with new token ids, positions and KV rows written to device memory before each replay:
// the results follow the new inputs, as they must when the engine replays a decode graph every step.
TEST_F(StepOpsTest, CapturedGraphReadsItsInputsFromDeviceMemory) {
  constexpr int kVocab = 512, kHidden = 256, kIntermediate = 96;
  const QkCase shape{4, 2, 64, 7};
  const int64_t tokens = shape.tokens;
  const std::vector<uint16_t> table = random_bf16(int64_t{kVocab} * kHidden, 501, -1.0f, 1.0f);
  const std::vector<float> delta = random_values(tokens * kHidden, 502, -1.0f, 1.0f);
  const std::vector<uint16_t> norm_weight = random_bf16(kHidden, 503, 0.25f, 2.0f);
  const std::vector<float> gate_up = random_values(tokens * 2 * kIntermediate, 504, -8.0f, 8.0f);
  QkProblem qk = make_qk_problem(shape, 505);  // qkv, norms, inv_freq fixed; positions and kv_rows change below

  const auto d_table = device_array(table);
  const auto d_delta = device_array(delta);
  const auto d_norm_weight = device_array(norm_weight);
  const auto d_gate_up = device_array(gate_up);
  const auto d_qkv = device_array(qk.qkv);
  const auto d_q_norm = device_array(qk.q_norm);
  const auto d_k_norm = device_array(qk.k_norm);
  const auto d_inv_freq = device_array(qk.inv_freq);
  DeviceBuffer d_ids(sizeof(int32_t) * tokens), d_positions(sizeof(int32_t) * tokens),
      d_kv_rows(sizeof(int32_t) * tokens);
  DeviceBuffer d_residual(sizeof(float) * tokens * kHidden), d_normed(sizeof(uint16_t) * tokens * kHidden);
  DeviceBuffer d_q_out(sizeof(uint16_t) * qk.q_expected.size()), d_act(sizeof(uint16_t) * tokens * kIntermediate);
  const int64_t pool_values = (qk.pool_rows + 1) * qk.kv_row_values;  // guard row + pool
  DeviceBuffer d_k_pool(sizeof(uint16_t) * pool_values), d_v_pool(sizeof(uint16_t) * pool_values);
  uint16_t* k_pool = d_k_pool.as<uint16_t>() + qk.kv_row_values;
  uint16_t* v_pool = d_v_pool.as<uint16_t>() + qk.kv_row_values;

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const std::unique_ptr<std::remove_pointer_t<cudaStream_t>, decltype(&cudaStreamDestroy)> stream_owner(
      stream, cudaStreamDestroy);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const cudaError_t launched[4] = {
      gpu::launch_embedding(d_table.ptr, d_ids.as<int32_t>(), tokens, kHidden, d_residual.as<float>(), stream),
      gpu::launch_add_rms_norm(d_residual.as<float>(), d_delta.ptr, d_norm_weight.ptr, kEps, nullptr, tokens, kHidden,
                               d_normed.as<uint16_t>(), stream),
      gpu::launch_qk_norm_rope_kv_append(d_qkv.ptr, d_q_norm.ptr, d_k_norm.ptr, kEps, d_positions.as<int32_t>(),
                                         d_inv_freq.ptr, d_kv_rows.as<int32_t>(), tokens, shape.num_heads,
                                         shape.num_kv_heads, shape.head_dim, d_q_out.as<uint16_t>(), k_pool, v_pool,
                                         stream),
      gpu::launch_silu_mul(d_gate_up.ptr, tokens, kIntermediate, d_act.as<uint16_t>(), stream)};
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  const std::unique_ptr<std::remove_pointer_t<cudaGraph_t>, decltype(&cudaGraphDestroy)> graph_owner(graph,
                                                                                                     cudaGraphDestroy);
  for (const cudaError_t status : launched) ASSERT_EQ(status, cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  const std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, decltype(&cudaGraphExecDestroy)> exec_owner(
      exec, cudaGraphExecDestroy);

  std::vector<uint16_t> act_expected(static_cast<size_t>(tokens * kIntermediate));
  ref::silu_mul(gate_up, tokens, kIntermediate, act_expected);
  for (uint32_t replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE(fmt::format("replay {}", replay));
    // New step inputs: token ids, positions, KV rows (from a fresh problem with the same weights).
    std::mt19937 rng(600 + replay);
    std::vector<int32_t> ids(static_cast<size_t>(tokens));
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % kVocab);
    const QkProblem step = make_qk_problem(shape, 505 + 100 * (replay + 1));
    qk.positions = step.positions;
    qk.kv_rows = step.kv_rows;
    qk.is_target = step.is_target;
    qk.k_pool_before = step.k_pool_before;
    qk.v_pool_before = step.v_pool_before;
    qk.guard_row = step.guard_row;
    qk.k_expected = qk.k_pool_before;
    qk.v_expected = qk.v_pool_before;
    ref::qk_norm_rope_kv_append(qk.qkv, qk.q_norm, qk.k_norm, kEps, qk.positions, qk.inv_freq, qk.kv_rows,
                                shape.num_heads, shape.num_kv_heads, shape.head_dim, qk.q_expected, qk.k_expected,
                                qk.v_expected);
    std::vector<float> residual_expected(static_cast<size_t>(tokens * kHidden));
    ref::embedding(table, ids, kHidden, residual_expected);
    std::vector<uint16_t> normed_expected(residual_expected.size());
    ref::add_rms_norm(residual_expected, delta, norm_weight, kEps, {}, kHidden, normed_expected);

    const auto upload = [](DeviceBuffer& dst, const auto& host) {
      return cudaMemcpy(dst.as<void>(), host.data(), sizeof(host[0]) * host.size(), cudaMemcpyHostToDevice);
    };
    std::vector<uint16_t> k_with_guard = qk.guard_row, v_with_guard = qk.guard_row;
    k_with_guard.insert(k_with_guard.end(), qk.k_pool_before.begin(), qk.k_pool_before.end());
    v_with_guard.insert(v_with_guard.end(), qk.v_pool_before.begin(), qk.v_pool_before.end());
    ASSERT_EQ(upload(d_ids, ids), cudaSuccess);
    ASSERT_EQ(upload(d_positions, qk.positions), cudaSuccess);
    ASSERT_EQ(upload(d_kv_rows, qk.kv_rows), cudaSuccess);
    ASSERT_EQ(upload(d_k_pool, k_with_guard), cudaSuccess);
    ASSERT_EQ(upload(d_v_pool, v_with_guard), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_residual.as<void>(), 0xff, d_residual.bytes()), cudaSuccess);  // NaN
    ASSERT_EQ(cudaMemset(d_normed.as<void>(), 0xff, d_normed.bytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_q_out.as<void>(), 0xff, d_q_out.bytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_act.as<void>(), 0xff, d_act.bytes()), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the non-blocking stream does not wait for the legacy one

    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(bitwise_equal(to_host(d_residual.as<float>(), tokens * kHidden), residual_expected));
    EXPECT_TRUE(within_one_bf16_step(to_host(d_normed.as<uint16_t>(), tokens * kHidden), normed_expected));
    expect_qk_outputs(qk, to_host(d_q_out.as<uint16_t>(), static_cast<int64_t>(qk.q_expected.size())),
                      to_host(d_k_pool.as<uint16_t>(), pool_values), to_host(d_v_pool.as<uint16_t>(), pool_values));
    EXPECT_TRUE(within_one_bf16_step(to_host(d_act.as<uint16_t>(), tokens * kIntermediate), act_expected));
  }
}

}  // namespace
}  // namespace fulcrum::test
