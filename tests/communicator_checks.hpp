#pragma once
// Checks every Communicator implementation must pass, run by each rank: every collective against its
// definition (awkward group sizes come from the caller), split groups and point to point.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "comm/communicator.hpp"

namespace fulcrum::test {

using comm::bytes_of;
using comm::Communicator;
using comm::writable_bytes_of;

inline void check_collectives(int rank, int n, Communicator& comm) {
  ASSERT_EQ(comm.rank(), rank);
  ASSERT_EQ(comm.size(), n);
  // all_reduce: x = rank + i -> sum_r (r + i)
  std::vector<float> x(5);
  for (int i = 0; i < 5; ++i) x[i] = static_cast<float>(rank + i);
  comm.all_reduce_sum(x);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(x[i], static_cast<float>(n * (n - 1) / 2 + n * i));
  // all_gather of 3 ints per rank
  std::vector<int> mine{rank, 10 * rank, 100 * rank}, all(3 * n);
  comm.all_gather(bytes_of(std::span<const int>(mine)), writable_bytes_of(std::span<int>(all)));
  for (int r = 0; r < n; ++r) EXPECT_EQ(all[3 * r + 1], 10 * r);
  // all_gather_v: rank r contributes r + 1 ints equal to r
  std::vector<int64_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = (r + 1) * static_cast<int64_t>(sizeof(int));
  std::vector<int> var(rank + 1, rank), gathered(n * (n + 1) / 2);
  comm.all_gather_v(bytes_of(std::span<const int>(var)), writable_bytes_of(std::span<int>(gathered)), counts);
  size_t k = 0;
  for (int r = 0; r < n; ++r) {
    for (int j = 0; j <= r; ++j) EXPECT_EQ(gathered[k++], r);
  }
  // reduce_scatter: block b of rank r holds (r * 100 + b) -> rank b gets sum_r (r * 100 + b)
  std::vector<float> blocks(2 * n), reduced(2);
  for (int b = 0; b < n; ++b) blocks[2 * b] = blocks[2 * b + 1] = static_cast<float>(rank * 100 + b);
  comm.reduce_scatter_sum(blocks, reduced);
  EXPECT_EQ(reduced[0], static_cast<float>(100 * n * (n - 1) / 2 + n * rank));
  // all_to_all_v: rank r sends (r + d) copies of value (r * 1000 + d) to rank d
  std::vector<int> send;
  std::vector<int64_t> send_counts(n), recv_counts(n);
  for (int d = 0; d < n; ++d) {
    for (int j = 0; j < rank + d; ++j) send.push_back(rank * 1000 + d);
    send_counts[d] = (rank + d) * static_cast<int64_t>(sizeof(int));
    recv_counts[d] = (d + rank) * static_cast<int64_t>(sizeof(int));
  }
  std::vector<int> recv(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0}) / sizeof(int));
  comm.all_to_all_v(bytes_of(std::span<const int>(send)), send_counts, writable_bytes_of(std::span<int>(recv)),
                    recv_counts);
  k = 0;
  for (int s = 0; s < n; ++s) {
    for (int j = 0; j < s + rank; ++j) EXPECT_EQ(recv[k++], s * 1000 + rank);
  }
  // broadcast from the last rank
  std::vector<int> value{rank == n - 1 ? 42 : -1};
  comm.broadcast(writable_bytes_of(std::span<int>(value)), n - 1);
  EXPECT_EQ(value[0], 42);
  // ring send/recv
  if (n > 1) {
    std::vector<int> out{rank}, in{-1};
    comm.send(bytes_of(std::span<const int>(out)), (rank + 1) % n);
    comm.recv(writable_bytes_of(std::span<int>(in)), (rank + n - 1) % n);
    EXPECT_EQ(in[0], (rank + n - 1) % n);
    // Sends are buffered: two 4 MiB messages go out before either side receives, a collective in between.
    std::vector<float> big(1 << 20);
    for (int m = 0; m < 2; ++m) {
      std::iota(big.begin(), big.end(), static_cast<float>(1000 * rank + m));
      comm.send(bytes_of(std::span<const float>(big)), (rank + 1) % n);
    }
    comm.barrier();
    for (int m = 0; m < 2; ++m) {
      comm.recv(writable_bytes_of(std::span<float>(big)), (rank + n - 1) % n);
      EXPECT_EQ(big[7], static_cast<float>(1000 * ((rank + n - 1) % n) + m + 7));
    }
  }
  comm.barrier();
}

// Needs a world of 6 ranks.
inline void check_split(int rank, Communicator& comm) {
  // color = rank % 2; key reverses the order inside each group
  auto sub = comm.split(rank % 2, -rank);
  EXPECT_EQ(sub->size(), 3);
  EXPECT_EQ(sub->rank(), 2 - rank / 2);
  std::vector<float> x{static_cast<float>(rank)};
  sub->all_reduce_sum(x);
  EXPECT_EQ(x[0], rank % 2 == 0 ? 0 + 2 + 4 : 1 + 3 + 5);
  // nested split and point to point inside a subgroup
  auto pair = sub->split(sub->rank() / 2, sub->rank());
  if (pair->size() == 2) {
    std::vector<int> v{rank}, got{-1};
    pair->send(bytes_of(std::span<const int>(v)), 1 - pair->rank());
    pair->recv(writable_bytes_of(std::span<int>(got)), 1 - pair->rank());
    EXPECT_EQ(got[0] % 2, rank % 2);
    EXPECT_NE(got[0], rank);
  }
}

// The outputs of every collective on random inputs (a pure function of rank and group size), to compare one
// implementation bitwise against another (the in-process communicator is the reference).
inline std::vector<std::vector<std::byte>> collective_outputs(int rank, int n, Communicator& comm) {
  std::mt19937 rng(1234 + rank);
  std::uniform_real_distribution<float> real(-3.0f, 3.0f);
  auto random_bytes = [&](size_t count) {
    std::vector<std::byte> out(count);
    for (auto& b : out) b = static_cast<std::byte>(rng() & 0xff);
    return out;
  };
  auto as_bytes = [](const std::vector<float>& v) {
    std::vector<std::byte> out(v.size() * sizeof(float));
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  };
  std::vector<std::vector<std::byte>> outputs;
  std::vector<float> x(1000);
  for (auto& v : x) v = real(rng) * (rank % 2 == 0 ? 1e4f : 1e-3f);  // sums that depend on the order
  comm.all_reduce_sum(x);
  outputs.push_back(as_bytes(x));

  std::vector<int64_t> gather_counts(n);
  for (int r = 0; r < n; ++r) gather_counts[r] = 100 * (r + 1) + 7;
  std::vector<std::byte> gathered(std::accumulate(gather_counts.begin(), gather_counts.end(), int64_t{0}));
  comm.all_gather_v(random_bytes(gather_counts[rank]), gathered, gather_counts);
  outputs.push_back(gathered);

  std::vector<float> blocks(static_cast<size_t>(n) * 333), reduced(333);
  for (auto& v : blocks) v = real(rng);
  comm.reduce_scatter_sum(blocks, reduced);
  outputs.push_back(as_bytes(reduced));

  auto bytes_between = [](int from, int to) -> int64_t { return (from + 2 * to) % 3 == 0 ? 0 : 50 * (from + 1) + 3 * to; };
  std::vector<int64_t> send_counts(n), recv_counts(n);
  for (int d = 0; d < n; ++d) {
    send_counts[d] = bytes_between(rank, d);
    recv_counts[d] = bytes_between(d, rank);
  }
  const std::vector<std::byte> send = random_bytes(std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0}));
  std::vector<std::byte> recv(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0}));
  comm.all_to_all_v(send, send_counts, recv, recv_counts);
  outputs.push_back(recv);

  std::vector<std::byte> value = random_bytes(12345);
  comm.broadcast(value, n - 1);
  outputs.push_back(value);
  return outputs;
}

}  // namespace fulcrum::test
