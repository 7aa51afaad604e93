#include "model/backend.hpp"

#include <cmath>

#include "eplb/error.hpp"

namespace fulcrum::model {

namespace {

// The one-page table of a contiguous cache.
constexpr int32_t kFirstPage = 0;
KvPages contiguous_pages(const Tensor& cache) { return KvPages{std::span(&kFirstPage, 1), cache.dim(0)}; }

}  // namespace

void check_kv_pages(const Tensor& pool, KvPages pages, int64_t end_pos, const char* what) {
  FULCRUM_CHECK(pool.rank() >= 1 && pages.page_size > 0, "{}: no kv pool or a page size of {}", what, pages.page_size);
  FULCRUM_CHECK(end_pos <= pages.capacity(), "{}: kv cache of capacity {} cannot take positions up to {}", what,
                pages.capacity(), end_pos);
  const int64_t num_pool_pages = pool.dim(0) / pages.page_size;
  for (const int32_t page_idx : pages.page_ids) {
    FULCRUM_CHECK(page_idx >= 0 && page_idx < num_pool_pages, "{}: page {} is outside the pool's {} pages", what,
                  page_idx, num_pool_pages);
  }
}

void check_paged_attention(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool, KvPages pages,
                           int64_t start_pos) {
  const int64_t num_tokens = q.dim(0), num_heads = q.dim(1), head_dim = q.dim(2);
  const int64_t num_kv_heads = k_pool.dim(1);
  FULCRUM_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && k_pool.dim(2) == head_dim,
                "attention: {} query heads of {} do not fit {} kv heads of {}", num_heads, head_dim, num_kv_heads,
                k_pool.dim(2));
  FULCRUM_CHECK(v_pool.shape() == k_pool.shape(), "attention: key and value pools differ in shape");
  FULCRUM_CHECK(start_pos >= 0, "attention: start position {}", start_pos);
  check_kv_pages(k_pool, pages, start_pos + num_tokens, "attention");
}

void Backend::write_kv(const Tensor& pool, const Tensor& src, KvPages pages, int64_t start_pos) {
  FULCRUM_CHECK(start_pos >= 0 && src.rank() >= 1, "write_kv: start position {}", start_pos);
  check_kv_pages(pool, pages, start_pos + src.dim(0), "write_kv");
  FULCRUM_CHECK(src.row_numel() == pool.row_numel(), "write_kv: kv pool rows hold {} values, source rows {}",
                pool.row_numel(), src.row_numel());
  std::vector<int32_t> rows(static_cast<size_t>(src.dim(0)));  // [num_tokens] pool row of each new position
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(pages.row(start_pos + static_cast<int64_t>(i)));
  scatter_rows(pool, src, rows);
}

void Backend::write_kv(const Tensor& cache, const Tensor& src, int64_t start_pos) {
  write_kv(cache, src, contiguous_pages(cache), start_pos);
}

Tensor Backend::attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int64_t start_pos) {
  return paged_attention(q, k_cache, v_cache, contiguous_pages(k_cache), start_pos);
}

std::vector<float> rope_inv_freq(int64_t head_dim, double rope_theta) {
  const int64_t half = head_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv_freq[i] = 1.0f / std::pow(static_cast<float>(rope_theta), exponent);
  }
  return inv_freq;
}

}  // namespace fulcrum::model
