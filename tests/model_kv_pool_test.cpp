// The paged KV pool on its own: page accounting (allocate, release, reuse, exhaustion, no growth once
// reserved), RAII return of pages, and the paged write/attention ops against a contiguous cache.
#include <algorithm>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "model/kv_pool.hpp"
#include "test_data.hpp"

namespace fulcrum::test {
namespace {

using model::KvCache;
using model::KvPool;
using model::Tensor;

constexpr int kLayers = 2;
constexpr int64_t kKvHeads = 2, kHeadDim = 4;

std::shared_ptr<KvPool> make_pool(backend::CpuBackend& cpu) {
  return std::make_shared<KvPool>(cpu, kLayers, kKvHeads, kHeadDim);
}

std::vector<int32_t> ids(const KvCache& cache) { return {cache.page_ids().begin(), cache.page_ids().end()}; }

Tensor random_tensor(backend::CpuBackend& cpu, std::vector<int64_t> shape, uint32_t seed) {
  Tensor t = cpu.zeros(std::move(shape));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data()[i] = dist(rng);
  return t;
}

TEST(KvPool, ReservedPoolAccountsPagesAndNeverGrows) {
  backend::CpuBackend cpu;
  const auto pool = make_pool(cpu);
  pool->reserve(4, 8);
  EXPECT_TRUE(pool->fixed());
  EXPECT_EQ(pool->bytes(), int64_t{2} * kLayers * 4 * 8 * kKvHeads * kHeadDim * 4);
  const float* k_data = pool->k(0).data();
  KvCache a = pool->create_cache(17);  // 3 pages, the last partly used
  EXPECT_EQ(ids(a), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(a.capacity, 17);
  EXPECT_EQ(pool->num_used_pages(), 3);
  EXPECT_EQ(pool->num_free_pages(), 1);
  EXPECT_EQ(error_of([&] { pool->create_cache(9); }), "KV pool exhausted: need 2 pages, 1 free");
  EXPECT_EQ(pool->num_pages(), 4);  // no growth, same memory
  EXPECT_EQ(pool->k(0).data(), k_data);
  KvCache b = pool->create_cache(8);
  EXPECT_EQ(ids(b), (std::vector<int32_t>{3}));
  EXPECT_EQ(pool->num_free_pages(), 0);
  EXPECT_NE(error_of([&] { pool->reserve(8, 8); }).find("4 pages are in use"), std::string::npos);
  a.release();
  EXPECT_EQ(a.capacity, 0);
  EXPECT_TRUE(a.page_ids().empty());
  EXPECT_EQ(pool->num_free_pages(), 3);
  KvCache c = pool->create_cache(24);  // the released pages come back, in their order
  EXPECT_EQ(ids(c), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(pool->k(0).data(), k_data);
  EXPECT_NE(error_of([&] { pool->create_cache(0); }).find("capacity must be positive"), std::string::npos);
  EXPECT_NE(error_of([] {
              backend::CpuBackend other;
              make_pool(other)->reserve(0, 8);
            }).find("0 pages of 8"),
            std::string::npos);
}

TEST(KvPool, CachesReturnTheirPagesWhenTheyGo) {
  backend::CpuBackend cpu;
  const auto pool = make_pool(cpu);
  pool->reserve(6, 4);
  {
    KvCache a = pool->create_cache(5);
    std::vector<KvCache> caches;
    caches.push_back(pool->create_cache(4));
    caches.push_back(std::move(a));  // moved: the pages follow, the source holds none
    EXPECT_TRUE(a.page_ids().empty());
    EXPECT_EQ(pool->num_used_pages(), 3);
    KvCache b = pool->create_cache(12);
    EXPECT_EQ(ids(b), (std::vector<int32_t>{3, 4, 5}));
    b = std::move(caches[0]);  // assigning over a cache returns its 3 pages
    EXPECT_EQ(pool->num_used_pages(), 3);
    EXPECT_EQ(ids(b), (std::vector<int32_t>{2}));
  }
  EXPECT_EQ(pool->num_used_pages(), 0);
  EXPECT_EQ(pool->num_free_pages(), 6);
  KvCache survivor = pool->create_cache(3);
  KvCache outlives;
  {
    auto local = make_pool(cpu);
    outlives = local->create_cache(3);
  }  // the pool is gone first: destroying the cache later returns nothing, touches nothing
  outlives.release();
  EXPECT_EQ(pool->num_used_pages(), 1);
}

TEST(KvPool, GrowingPoolKeepsPagesInUse) {
  backend::CpuBackend cpu;
  const auto pool = make_pool(cpu);
  EXPECT_EQ(pool->num_pages(), 0);
  EXPECT_FALSE(pool->fixed());
  KvCache a = pool->create_cache(1);
  EXPECT_EQ(pool->page_size(), KvPool::kDefaultPageSize);
  EXPECT_EQ(pool->num_pages(), KvPool::kGrowPages);  // one chunk
  const Tensor rows = random_tensor(cpu, {1, kKvHeads, kHeadDim}, 1);
  cpu.write_kv(pool->k(1), rows, pool->pages_of(a), 0);
  const int64_t row = pool->pages_of(a).row(0);
  // More than the free pages: the pool at least doubles, in whole chunks, and keeps what `a` holds.
  KvCache big = pool->create_cache(KvPool::kDefaultPageSize * (KvPool::kGrowPages + 3));
  EXPECT_EQ(pool->num_pages(), 2 * KvPool::kGrowPages);
  EXPECT_EQ(pool->num_used_pages(), KvPool::kGrowPages + 4);
  EXPECT_EQ(cpu.download(pool->k(1).rows(row, 1)), cpu.download(rows));
}

// Page ids out of order and not adjacent, page_size not dividing the lengths.
TEST(KvPool, PagedWriteAndAttentionEqualContiguous) {
  backend::CpuBackend cpu;
  const int64_t num_heads = 4, page_size = 5, num_pool_pages = 8, length = 19;
  const std::vector<int32_t> page_ids = {6, 1, 4, 2};
  const model::KvPages pages{page_ids, page_size};
  const Tensor k_pool = cpu.zeros({num_pool_pages * page_size, kKvHeads, kHeadDim});
  const Tensor v_pool = cpu.zeros({num_pool_pages * page_size, kKvHeads, kHeadDim});
  const Tensor k_cache = cpu.zeros({length, kKvHeads, kHeadDim});
  const Tensor v_cache = cpu.zeros({length, kKvHeads, kHeadDim});
  int64_t start_pos = 0;
  uint32_t seed = 10;
  for (const int64_t num_tokens : {7, 1, 11}) {  // chunks crossing page boundaries
    const Tensor k_new = random_tensor(cpu, {num_tokens, kKvHeads, kHeadDim}, ++seed);
    const Tensor v_new = random_tensor(cpu, {num_tokens, kKvHeads, kHeadDim}, ++seed);
    const Tensor q = random_tensor(cpu, {num_tokens, num_heads, kHeadDim}, ++seed);
    cpu.write_kv(k_pool, k_new, pages, start_pos);
    cpu.write_kv(v_pool, v_new, pages, start_pos);
    cpu.write_kv(k_cache, k_new, start_pos);
    cpu.write_kv(v_cache, v_new, start_pos);
    EXPECT_EQ(cpu.download(cpu.paged_attention(q, k_pool, v_pool, pages, start_pos)),
              cpu.download(cpu.attention(q, k_cache, v_cache, start_pos)))
        << "chunk at " << start_pos;
    start_pos += num_tokens;
  }
  for (int64_t pos = 0; pos < length; ++pos) {
    const int64_t row = page_ids[pos / page_size] * page_size + pos % page_size;
    EXPECT_EQ(cpu.download(k_pool.rows(row, 1)), cpu.download(k_cache.rows(pos, 1))) << "position " << pos;
  }
  for (const int64_t unused_page : {0, 3, 5, 7}) {
    const auto values = cpu.download(v_pool.rows(unused_page * page_size, page_size));
    EXPECT_TRUE(std::all_of(values.begin(), values.end(), [](float x) { return x == 0.0f; })) << unused_page;
  }
  const Tensor one = random_tensor(cpu, {2, kKvHeads, kHeadDim}, 99);
  EXPECT_NE(error_of([&] { cpu.write_kv(k_pool, one, pages, length); }).find("capacity 20 cannot take positions up to 21"),
            std::string::npos);
  const std::vector<int32_t> outside = {1, 8};
  EXPECT_NE(error_of([&] { cpu.write_kv(k_pool, one, model::KvPages{outside, page_size}, 4); })
                .find("page 8 is outside the pool's 8 pages"),
            std::string::npos);
  const Tensor q = random_tensor(cpu, {2, num_heads, kHeadDim}, 98);
  EXPECT_NE(error_of([&] { cpu.paged_attention(q, k_pool, v_pool, pages, length); }).find("attention: kv cache"),
            std::string::npos);
}

}  // namespace
}  // namespace fulcrum::test
