// model::parallel_chunks (src/model/parallel_chunks.hpp) and the CPU GEMMs it splits: every index once, in
// contiguous chunks, and the threaded results bitwise those of one thread.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
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

}  // namespace
}  // namespace fulcrum::test
