// The CUDA backend against the CPU reference, operation by operation, on the same random inputs with
// awkward sizes (1, 19 and 33 tokens; head_dim 16 and 128; hidden 64 and 2048; vocab 256; 128 experts top-8;
// an expert with zero tokens). Every test skips when no CUDA device is present.
//
// Tolerances (error = |cuda - cpu| / max(1, |cpu|): absolute below magnitude 1, relative above):
//   exact (0)  copy, embedding, write_kv (one scatter_rows), gather/scatter rows, add_inplace, weighted_sum (same fp32
//              operations in the same order, no FMA contraction), rope (host-computed angles, same
//              rotation), route expert ids (same fp32 probabilities; ties to the lower index)
//   1e-6       rms_norm (sum of squares in double on both; only the summation order differs),
//              route weights (double softmax on both, rounded to fp32)
//   1e-5       silu_mul (device expf differs from glibc's by a few ulp)
//   1e-4       matmul (cuBLAS fp32 accumulation vs the CPU's double), attention (fp32 softmax and
//              accumulation vs double; paged attention: cuda_paged_kv_test.cpp)
#include <numeric>

#include <fmt/format.h>

#include "cuda_test_util.hpp"

namespace fulcrum::test {
namespace {

TEST_F(CudaBackendTest, MemoryRoundTripAndCopy) {
  const std::vector<float> values = random_values(19 * 64, 1);
  Tensor t = cuda_->zeros({19, 64});
  EXPECT_EQ(t.device(), model::Device::kCuda);
  EXPECT_EQ(cuda_->download(t), std::vector<float>(values.size(), 0.0f));
  cuda_->upload(t, values);
  EXPECT_EQ(cuda_->download(t), values);
  Tensor u = cuda_->zeros({19, 64});
  cuda_->copy(u.rows(3, 5), t.rows(10, 5));  // views alias their parent
  const std::vector<float> got = cuda_->download(u);
  for (int64_t i = 0; i < 19 * 64; ++i) {
    const float expected = (i >= 3 * 64 && i < 8 * 64) ? values[static_cast<size_t>(i + 7 * 64)] : 0.0f;
    ASSERT_EQ(got[static_cast<size_t>(i)], expected) << i;
  }
  const Tensor empty = cuda_->zeros({0, 64});
  EXPECT_TRUE(cuda_->download(empty).empty());
  cuda_->upload(empty, {});
  EXPECT_THROW(cuda_->upload(t, std::vector<float>(3)), Error);
  EXPECT_THROW(cuda_->download(cpu_.zeros({2})), Error);
}

TEST_F(CudaBackendTest, EmbeddingIsExact) {
  for (const int64_t hidden : {64, 2048}) {
    const auto [table_cpu, table_cuda] = random_both({256, hidden}, 2);
    for (const int num_tokens : {1, 19, 33}) {
      std::vector<int32_t> ids(static_cast<size_t>(num_tokens));
      for (int t = 0; t < num_tokens; ++t) ids[t] = (t * 97 + 5) % 256;
      ids.back() = 255;
      expect_close(cuda_->embedding(table_cuda, ids), cpu_.embedding(table_cpu, ids), kExact,
                   "hidden " + std::to_string(hidden) + " tokens " + std::to_string(num_tokens));
    }
    const std::vector<int32_t> bad = {0, 256};
    EXPECT_THROW(cuda_->embedding(table_cuda, bad), Error);
  }
}

TEST_F(CudaBackendTest, RmsNormMatchesCpu) {
  for (const int64_t dim : {64, 2048}) {
    const auto [w_cpu, w_cuda] = random_both({dim}, 3, 0.5f, 1.5f);
    for (const int64_t rows : {1, 19, 33}) {
      const auto [x_cpu, x_cuda] = random_both({rows, dim}, 4 + static_cast<uint32_t>(rows), -3.0f, 3.0f);
      expect_close(cuda_->rms_norm(x_cuda, w_cuda, 1e-6f), cpu_.rms_norm(x_cpu, w_cpu, 1e-6f), kNormTolerance,
                   "dim " + std::to_string(dim) + " rows " + std::to_string(rows));
    }
  }
  // Per-head norm (q_norm / k_norm): x [num_tokens, num_heads, head_dim], weight [head_dim].
  for (const int64_t head_dim : {16, 128}) {
    const auto [w_cpu, w_cuda] = random_both({head_dim}, 5, 0.5f, 1.5f);
    const auto [x_cpu, x_cuda] = random_both({19, 4, head_dim}, 6);
    expect_close(cuda_->rms_norm(x_cuda, w_cuda, 1e-6f), cpu_.rms_norm(x_cpu, w_cpu, 1e-6f), kNormTolerance,
                 "head_dim " + std::to_string(head_dim));
  }
}

TEST_F(CudaBackendTest, MatmulMatchesCpu) {
  for (const int64_t in_features : {64, 2048}) {
    for (const int64_t out_features : {int64_t{256}, int64_t{96}, in_features}) {
      // Weights scaled like an initializer (1 / sqrt(in_features)), so outputs are O(1) as in the model.
      const float w_scale = 1.0f / std::sqrt(static_cast<float>(in_features));
      const auto [w_cpu, w_cuda] = random_both({out_features, in_features}, 7, -w_scale, w_scale);
      for (const int64_t rows : {0, 1, 19, 33}) {  // 0: an expert with no tokens
        const auto [x_cpu, x_cuda] = random_both({rows, in_features}, 8 + static_cast<uint32_t>(rows));
        expect_close(cuda_->matmul(x_cuda, w_cuda), cpu_.matmul(x_cpu, w_cpu), kMatmulTolerance,
                     fmt::format("[{}, {}] @ [{}, {}]^T", rows, in_features, out_features, in_features));
      }
    }
  }
  // Expert weights are views into a [num_slots, out, in] tensor.
  const auto [experts_cpu, experts_cuda] = random_both({4, 32, 64}, 9);
  const auto [x_cpu, x_cuda] = random_both({19, 64}, 10);
  expect_close(cuda_->matmul(x_cuda, experts_cuda.index(3)), cpu_.matmul(x_cpu, experts_cpu.index(3)),
               kMatmulTolerance, "expert view");
}

TEST_F(CudaBackendTest, RopeIsExact) {
  for (const int64_t head_dim : {16, 128}) {
    for (const int num_tokens : {1, 19, 33}) {
      for (const double theta : {10000.0, 1000000.0}) {
        const auto [x_cpu, x_cuda] = random_both({num_tokens, 4, head_dim}, 11);
        std::vector<int32_t> positions(static_cast<size_t>(num_tokens));
        std::iota(positions.begin(), positions.end(), num_tokens == 1 ? 4000 : 7);
        cpu_.rope_inplace(x_cpu, positions, theta);
        cuda_->rope_inplace(x_cuda, positions, theta);
        expect_close(x_cuda, x_cpu, kExact,
                     "head_dim " + std::to_string(head_dim) + " tokens " + std::to_string(num_tokens));
      }
    }
  }
}

TEST_F(CudaBackendTest, WriteKvAndAttentionMatchCpu) {
  struct Case {
    int64_t num_heads, num_kv_heads, head_dim;
  };
  for (const Case c : {Case{4, 2, 16}, Case{4, 4, 128}, Case{32, 4, 128}}) {
    const int64_t capacity = 64;
    const auto [k_cpu, k_cuda] = both({capacity, c.num_kv_heads, c.head_dim},
                                      std::vector<float>(static_cast<size_t>(capacity * c.num_kv_heads * c.head_dim)));
    const auto [v_cpu, v_cuda] = both({capacity, c.num_kv_heads, c.head_dim},
                                      std::vector<float>(static_cast<size_t>(capacity * c.num_kv_heads * c.head_dim)));
    // Prefill 19 tokens, decode 1, then a chunk of 33 at position 20: queries see the cache causally.
    int64_t start_pos = 0;
    uint32_t seed = 20;
    for (const int64_t num_tokens : {19, 1, 33}) {
      const std::string what = "heads " + std::to_string(c.num_heads) + "/" + std::to_string(c.num_kv_heads) +
                               " head_dim " + std::to_string(c.head_dim) + " start " + std::to_string(start_pos);
      const auto [kn_cpu, kn_cuda] = random_both({num_tokens, c.num_kv_heads, c.head_dim}, ++seed, -2.0f, 2.0f);
      const auto [vn_cpu, vn_cuda] = random_both({num_tokens, c.num_kv_heads, c.head_dim}, ++seed);
      cpu_.write_kv(k_cpu, kn_cpu, start_pos);
      cuda_->write_kv(k_cuda, kn_cuda, start_pos);
      cpu_.write_kv(v_cpu, vn_cpu, start_pos);
      cuda_->write_kv(v_cuda, vn_cuda, start_pos);
      expect_close(k_cuda, k_cpu, kExact, "key cache, " + what);
      expect_close(v_cuda, v_cpu, kExact, "value cache, " + what);
      const auto [q_cpu, q_cuda] = random_both({num_tokens, c.num_heads, c.head_dim}, ++seed, -2.0f, 2.0f);
      expect_close(cuda_->attention(q_cuda, k_cuda, v_cuda, start_pos), cpu_.attention(q_cpu, k_cpu, v_cpu, start_pos),
                   kAttentionTolerance, "attention, " + what);
      start_pos += num_tokens;
    }
    const auto [too_many_cpu, too_many_cuda] = random_both({capacity, c.num_kv_heads, c.head_dim}, 99);
    EXPECT_THROW(cuda_->write_kv(k_cuda, too_many_cuda, 1), Error);
  }
}

TEST_F(CudaBackendTest, SiluMulAndAddMatchCpu) {
  for (const int64_t rows : {0, 1, 19, 33}) {
    for (const int64_t width : {64, 768}) {
      const auto [g_cpu, g_cuda] = random_both({rows, 2 * width}, 30, -8.0f, 8.0f);
      expect_close(cuda_->silu_mul(g_cuda), cpu_.silu_mul(g_cpu), kElementwiseTolerance,
                   "silu_mul rows " + std::to_string(rows) + " width " + std::to_string(width));
      const auto [x_cpu, x_cuda] = random_both({rows, width}, 31);
      const auto [y_cpu, y_cuda] = random_both({rows, width}, 32);
      cpu_.add_inplace(x_cpu, y_cpu);
      cuda_->add_inplace(x_cuda, y_cuda);
      expect_close(x_cuda, x_cpu, kExact, "add rows " + std::to_string(rows));
    }
  }
}

void expect_same_choice(const model::RouterChoice& on_cuda, const model::RouterChoice& on_cpu,
                        const std::string& what) {
  EXPECT_EQ(on_cuda.top_k, on_cpu.top_k) << what;
  EXPECT_EQ(on_cuda.expert_ids, on_cpu.expert_ids) << what;
  EXPECT_LE(scaled_error(on_cuda.weights, on_cpu.weights), kRouteWeightTolerance) << what;
}

TEST_F(CudaBackendTest, RouteMatchesCpuIncludingTies) {
  for (const int num_experts : {128, 16}) {
    const int top_k = num_experts == 128 ? 8 : 2;
    for (const int num_tokens : {1, 19, 33}) {
      std::vector<float> logits = random_values(int64_t{num_tokens} * num_experts, 40, -4.0f, 4.0f);
      // Exact ties: token 0 repeats its best logit on a higher expert; the last token is all equal.
      const auto best = std::max_element(logits.begin(), logits.begin() + num_experts);
      logits[num_experts - 1] = *best;
      logits[static_cast<size_t>(std::distance(logits.begin(), best)) / 2] = *best;
      if (num_tokens > 1) std::fill(logits.end() - num_experts, logits.end(), 0.25f);
      const auto [l_cpu, l_cuda] = both({num_tokens, num_experts}, logits);
      for (const bool norm : {true, false}) {
        expect_same_choice(cuda_->route(l_cuda, top_k, norm), cpu_.route(l_cpu, top_k, norm),
                           std::to_string(num_experts) + " experts top-" + std::to_string(top_k) + " tokens " +
                               std::to_string(num_tokens) + (norm ? " renormalized" : ""));
      }
    }
  }
  const auto [l_cpu, l_cuda] = random_both({3, 16}, 41);
  EXPECT_THROW(cuda_->route(l_cuda, 17, true), Error);
  const auto [e_cpu, e_cuda] = random_both({0, 128}, 42);
  EXPECT_TRUE(cuda_->route(e_cuda, 8, true).expert_ids.empty());
}

// The MoE block's data movement: route 19 tokens to 128 experts top-8 (most experts get no token), gather
// each expert's tokens, apply a per-expert matmul, scatter into the entry rows, weighted sum.
TEST_F(CudaBackendTest, MoeGatherScatterWeightedSumMatchCpu) {
  const int num_tokens = 19, num_experts = 128, top_k = 8, hidden = 64;
  const auto [x_cpu, x_cuda] = random_both({num_tokens, hidden}, 50);
  const auto [w_cpu, w_cuda] = random_both({num_experts, hidden, hidden}, 51);
  const auto [l_cpu, l_cuda] = random_both({num_tokens, num_experts}, 52, -4.0f, 4.0f);
  const model::RouterChoice choice = cpu_.route(l_cpu, top_k, true);
  expect_same_choice(cuda_->route(l_cuda, top_k, true), choice, "routing");

  std::vector<std::vector<int32_t>> tokens(num_experts), entries(num_experts);
  for (int t = 0; t < num_tokens; ++t) {
    for (int j = 0; j < top_k; ++j) {
      const int expert = choice.expert_ids[t * top_k + j];
      tokens[expert].push_back(t);
      entries[expert].push_back(t * top_k + j);
    }
  }
  ASSERT_TRUE(std::any_of(tokens.begin(), tokens.end(), [](const auto& v) { return v.empty(); }));
  Tensor out_cpu = cpu_.zeros({num_tokens * top_k, hidden});
  Tensor out_cuda = cuda_->zeros({num_tokens * top_k, hidden});
  for (int e = 0; e < num_experts; ++e) {
    const Tensor xs_cpu = cpu_.gather_rows(x_cpu, tokens[e]);  // [n, hidden], n may be 0
    const Tensor xs_cuda = cuda_->gather_rows(x_cuda, tokens[e]);
    expect_close(xs_cuda, xs_cpu, kExact, "gather, expert " + std::to_string(e));
    // The same rows on both sides from here, so that scatter and weighted_sum are compared exactly.
    const Tensor ys_cpu = cpu_.matmul(xs_cpu, w_cpu.index(e));
    Tensor ys_cuda = cuda_->zeros(ys_cpu.shape());
    cuda_->upload(ys_cuda, cpu_.download(ys_cpu));
    cpu_.scatter_rows(out_cpu, ys_cpu, entries[e]);
    cuda_->scatter_rows(out_cuda, ys_cuda, entries[e]);
  }
  expect_close(out_cuda, out_cpu, kExact, "scatter");
  expect_close(cuda_->weighted_sum(out_cuda, choice.weights, top_k), cpu_.weighted_sum(out_cpu, choice.weights, top_k),
               kExact, "weighted_sum");
  const std::vector<int32_t> bad = {0, num_tokens};
  EXPECT_THROW(cuda_->gather_rows(x_cuda, bad), Error);
}

}  // namespace
}  // namespace fulcrum::test
