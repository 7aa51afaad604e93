// The paged KV path on CUDA against the CPU reference: paged write_kv (exact) and paged attention
// (kAttentionTolerance vs the CPU, and bit-identical to CUDA attention on a contiguous cache), with page
// sizes that divide no chunk length (1, 5, 64) and page ids out of order with gaps; then the whole model,
// whose logits must not change bit for bit with the page layout.
#include <numeric>

#include <fmt/format.h>

#include "cuda_test_util.hpp"
#include "model_paged_kv_util.hpp"

namespace fulcrum::test {
namespace {

TEST_F(CudaBackendTest, PagedWriteKvAndAttentionMatchCpu) {
  struct Case {
    int64_t num_heads, num_kv_heads, head_dim;
  };
  const int64_t length = 53;  // prefill 19, decode 1, a chunk of 33
  for (const Case c : {Case{4, 2, 16}, Case{32, 4, 128}}) {
    for (const int64_t page_size : {1, 5, 64}) {
      const int64_t num_table_pages = (length + page_size - 1) / page_size;
      const int64_t num_pool_pages = 2 * num_table_pages + 1;
      std::vector<int32_t> page_ids(static_cast<size_t>(num_pool_pages));  // a shuffled subset of the pool
      std::iota(page_ids.begin(), page_ids.end(), 0);
      std::shuffle(page_ids.begin(), page_ids.end(), std::mt19937(static_cast<uint32_t>(page_size)));
      page_ids.resize(static_cast<size_t>(num_table_pages));
      const model::KvPages pages{page_ids, page_size};
      const std::vector<int64_t> pool_shape = {num_pool_pages * page_size, c.num_kv_heads, c.head_dim};
      const std::vector<float> pool_zeros(static_cast<size_t>(pool_shape[0] * c.num_kv_heads * c.head_dim));
      const auto [k_cpu, k_cuda] = both(pool_shape, pool_zeros);
      const auto [v_cpu, v_cuda] = both(pool_shape, pool_zeros);
      const Tensor k_contiguous = cuda_->zeros({length, c.num_kv_heads, c.head_dim});
      const Tensor v_contiguous = cuda_->zeros({length, c.num_kv_heads, c.head_dim});
      int64_t start_pos = 0;
      uint32_t seed = 40;
      for (const int64_t num_tokens : {19, 1, 33}) {
        const std::string what = fmt::format("heads {}/{} head_dim {} page_size {} start {}", c.num_heads,
                                             c.num_kv_heads, c.head_dim, page_size, start_pos);
        const auto [kn_cpu, kn_cuda] = random_both({num_tokens, c.num_kv_heads, c.head_dim}, ++seed, -2.0f, 2.0f);
        const auto [vn_cpu, vn_cuda] = random_both({num_tokens, c.num_kv_heads, c.head_dim}, ++seed);
        cpu_.write_kv(k_cpu, kn_cpu, pages, start_pos);
        cuda_->write_kv(k_cuda, kn_cuda, pages, start_pos);
        cpu_.write_kv(v_cpu, vn_cpu, pages, start_pos);
        cuda_->write_kv(v_cuda, vn_cuda, pages, start_pos);
        cuda_->write_kv(k_contiguous, kn_cuda, start_pos);
        cuda_->write_kv(v_contiguous, vn_cuda, start_pos);
        expect_close(k_cuda, k_cpu, kExact, "key pool, " + what);
        expect_close(v_cuda, v_cpu, kExact, "value pool, " + what);
        const auto [q_cpu, q_cuda] = random_both({num_tokens, c.num_heads, c.head_dim}, ++seed, -2.0f, 2.0f);
        const Tensor paged = cuda_->paged_attention(q_cuda, k_cuda, v_cuda, pages, start_pos);
        expect_close(paged, cpu_.paged_attention(q_cpu, k_cpu, v_cpu, pages, start_pos), kAttentionTolerance,
                     "paged attention, " + what);
        EXPECT_EQ(cuda_->download(paged), cuda_->download(cuda_->attention(q_cuda, k_contiguous, v_contiguous, start_pos)))
            << "paged vs contiguous attention on CUDA, " << what;
        start_pos += num_tokens;
      }
      const auto [q_cpu, q_cuda] = random_both({page_size * num_table_pages - length + 1, c.num_heads, c.head_dim}, 7);
      EXPECT_THROW(cuda_->paged_attention(q_cuda, k_cuda, v_cuda, pages, length), Error);  // one past the table
      const std::vector<int32_t> outside = {static_cast<int32_t>(num_pool_pages)};
      EXPECT_THROW(cuda_->paged_attention(q_cuda.rows(0, 1), k_cuda, v_cuda, model::KvPages{outside, page_size}, 0),
                   Error);
    }
  }
}

TEST_F(CudaBackendTest, ModelLogitsDoNotDependOnThePageLayout) {
  expect_page_layout_does_not_change_logits(*cuda_);
}

}  // namespace
}  // namespace fulcrum::test
