#pragma once
// Runs f(begin, end) over contiguous chunks of [0, n) on several std::threads (the calling thread takes the first).
// For CPU references whose items are independent, each computed by one thread in the one-thread order, so a result
// is bitwise that of a single thread; what it buys is the GPU test suite's time on the 16-core GPU machine, where
// the references, not the kernels, held most of it. Jobs below ~4M multiply-adds run inline. f must not throw.
#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace fulcrum::model {

inline int reference_threads() {
  static const int threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 16u));
  return threads;
}

template <typename F>
void parallel_chunks(int64_t n, int64_t cost_per_item, F&& f) {
  constexpr int64_t kWorkPerThread = int64_t{1} << 22;
  const int64_t by_work = std::max<int64_t>(1, n * std::max<int64_t>(1, cost_per_item) / kWorkPerThread);
  const int64_t threads = std::min<int64_t>({reference_threads(), by_work, std::max<int64_t>(1, n)});
  if (threads <= 1) {
    f(int64_t{0}, n);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
  std::vector<std::thread> workers;
  for (int64_t begin = chunk; begin < n; begin += chunk) {
    workers.emplace_back([&f, begin, end = std::min(n, begin + chunk)] { f(begin, end); });
  }
  f(int64_t{0}, std::min(n, chunk));
  for (std::thread& t : workers) t.join();
}

}  // namespace fulcrum::model
