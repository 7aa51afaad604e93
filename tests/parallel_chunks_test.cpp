// model::parallel_chunks (src/model/parallel_chunks.hpp) and the CPU GEMMs it splits: every index once, in
// contiguous chunks, and the threaded results bitwise those of one thread.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "model/parallel_chunks.hpp"

namespace fulcrum::test {
namespace {

std::vector<std::pair<int64_t, int64_t>> chunks_of(int64_t n, int64_t cost) {
  std::mutex mutex;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  model::parallel_chunks(n, cost, [&](int64_t begin, int64_t end) {
    std::lock_guard lock(mutex);
    chunks.emplace_back(begin, end);
  });
  std::sort(chunks.begin(), chunks.end());
  return chunks;
}

TEST(ParallelChunks, CoversEveryIndexOnceInContiguousChunks) {
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{100003}}) {
    for (const int64_t cost : {int64_t{1}, int64_t{1} << 12, int64_t{1} << 22}) {
      const auto chunks = chunks_of(n, cost);
      int64_t next = 0;
      for (const auto& [begin, end] : chunks) {
        EXPECT_EQ(begin, next) << "n " << n << " cost " << cost;
        EXPECT_LE(begin, end);
        next = end;
      }
      EXPECT_EQ(next, n) << "n " << n << " cost " << cost;
      EXPECT_LE(static_cast<int64_t>(chunks.size()), std::max(1, model::reference_threads()));
    }
  }
}

TEST(ParallelChunks, SmallJobsRunInlineLargeOnesSplit) {
  EXPECT_EQ(chunks_of(1000, 1).size(), 1u);  // 1000 multiply-adds: not worth a thread
  const size_t large = chunks_of(4096, int64_t{1} << 22).size();
  EXPECT_EQ(large, static_cast<size_t>(model::reference_threads()));
}

// CpuBackend::matmul over threads equals the one-thread double-accumulated sum of each element, bit for bit.
TEST(ParallelChunks, ThreadedCpuMatmulEqualsTheSerialSums) {
  backend::CpuBackend cpu;
  const int64_t rows = 3, in = 1536, out = 2304;  // 10.6M multiply-adds: split over the threads
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> xs(static_cast<size_t>(rows * in)), ws(static_cast<size_t>(out * in));
  for (float& v : xs) v = normal(rng);
  for (float& v : ws) v = normal(rng);
  const model::Tensor x = cpu.zeros({rows, in}), w = cpu.zeros({out, in});
  cpu.upload(x, xs);
  cpu.upload(w, ws);
  const std::vector<float> got = cpu.download(cpu.matmul(x, w));
  ASSERT_EQ(got.size(), static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < in; ++i) acc += static_cast<double>(xs[r * in + i]) * ws[o * in + i];
      const float want = static_cast<float>(acc);
      ASSERT_EQ(std::memcmp(&got[r * out + o], &want, 4), 0) << "row " << r << " column " << o;
    }
  }
}

// CpuBackend::paged_attention over threads ((token, head) pairs split): a 64-token chunk after 1000 cached positions
// equals the same tokens attended one call each, bit for bit.
TEST(ParallelChunks, ThreadedCpuAttentionEqualsTokenByToken) {
  backend::CpuBackend cpu;
  const int64_t heads = 8, kv_heads = 2, dim = 64, page = 16, start = 1000, tokens = 64;
  const int64_t positions = start + tokens, num_pages = (positions + page - 1) / page;
  std::vector<int32_t> page_ids(static_cast<size_t>(num_pages));
  std::iota(page_ids.begin(), page_ids.end(), 0);
  std::shuffle(page_ids.begin(), page_ids.end(), std::mt19937(3));
  const model::KvPages pages{page_ids, page};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  const auto random = [&](std::vector<int64_t> shape) {
    const model::Tensor t = cpu.zeros(shape);
    std::vector<float> values(static_cast<size_t>(t.numel()));
    for (float& v : values) v = normal(rng);
    cpu.upload(t, values);
    return t;
  };
  const model::Tensor k_pool = random({num_pages * page, kv_heads, dim}), v_pool = random({num_pages * page, kv_heads, dim});
  const model::Tensor q = random({tokens, heads, dim});
  const std::vector<float> chunk = cpu.download(cpu.paged_attention(q, k_pool, v_pool, pages, start));
  for (int64_t t = 0; t < tokens; ++t) {
    const std::vector<float> one = cpu.download(cpu.paged_attention(q.rows(t, 1), k_pool, v_pool, pages, start + t));
    ASSERT_EQ(std::memcmp(one.data(), chunk.data() + t * heads * dim, sizeof(float) * one.size()), 0) << "token " << t;
  }
}

}  // namespace
}  // namespace fulcrum::test
