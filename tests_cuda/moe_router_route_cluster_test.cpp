// The router + route cluster launch (cuda::moe::launch_router_route_cluster) against the two launches it replaces
// (gpu::launch_skinny_gemm for the router logits, then cuda::moe::launch_small_route_permute): every output bit for
// bit (logits, experts, weights, slots, recorder histogram, the permutation plan), at the Qwen3-30B-A3B and
// Qwen3-235B-A22B router shapes (one and two router tiles a block, two to four at 235B) and 1..4 tokens. The CPU
// reference of both halves is the existing path's (skinny_gemm_reference, the router and permutation tests).
#include <cstdint>
#include <numeric>
#include <vector>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "gpu/kernels/skinny_gemm.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "gpu/moe/router_route_cluster.hpp"
#include "moe_cuda_test_util.hpp"
#include "skinny_test_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;

struct RouteOutputs {
  DeviceBuffer logits, ids, weights, slot, counts, offsets, entry_row, row_token, active, histogram;
};

RouteOutputs make_outputs(int tokens, int experts, int top_k, int slots) {
  const int entries = tokens * top_k;
  RouteOutputs o{DeviceBuffer(4 * tokens * experts), DeviceBuffer(4 * entries), DeviceBuffer(4 * entries),
                 DeviceBuffer(4 * entries),          DeviceBuffer(4 * slots),   DeviceBuffer(4 * (slots + 1)),
                 DeviceBuffer(4 * entries),          DeviceBuffer(4 * entries), DeviceBuffer(4 * (slots + 1)),
                 DeviceBuffer(8 * experts)};
  // Poisoned, so an output the kernel fails to write shows as a difference (the histogram adds to its row).
  for (DeviceBuffer* b : {&o.logits, &o.ids, &o.weights, &o.slot, &o.counts, &o.offsets, &o.entry_row, &o.row_token,
                          &o.active}) {
    EXPECT_EQ(cudaMemset(b->as<void>(), 0x7f, b->bytes()), cudaSuccess);
  }
  EXPECT_EQ(cudaMemset(o.histogram.as<void>(), 0, o.histogram.bytes()), cudaSuccess);
  return o;
}

cuda::moe::RouterArgs args_for(RouteOutputs& o, int tokens, int experts, int top_k, int sources,
                               const int32_t* slot_of) {
  cuda::moe::RouterArgs a;
  a.logits = o.logits.as<float>();
  a.num_tokens = tokens;
  a.num_experts = experts;
  a.top_k = top_k;
  a.tokens_per_source = (tokens + sources - 1) / sources;
  a.static_slot_of = slot_of;
  a.expert_ids = o.ids.as<int32_t>();
  a.weights = o.weights.as<float>();
  a.slots = o.slot.as<int32_t>();
  a.histogram = o.histogram.as<unsigned long long>();
  return a;
}

TEST(RouterRouteClusterTest, EqualsTheRouterGemmAndTheSmallRouteBitForBit) {
  const int experts = 128, top_k = 8, slots = 136, sources = 2;
  for (const int hidden : {2048, 4096}) {
    for (int tokens = 1; tokens <= cuda::moe::kRouterClusterMaxTokens; ++tokens) {
      SCOPED_TRACE(fmt::format("hidden {}, tokens {}", hidden, tokens));
      ASSERT_TRUE(cuda::moe::router_route_cluster_fits(tokens, experts, top_k, hidden, slots));
      const auto x_bits = skinny_test::random_bf16(static_cast<size_t>(tokens) * hidden, 11 + tokens);
      const auto w_bits = skinny_test::random_bf16(static_cast<size_t>(experts) * hidden, 29 + hidden);
      std::vector<int32_t> slot_of(static_cast<size_t>(sources) * experts);  // source 1: experts 0..7 on replicas
      for (int src = 0; src < sources; ++src) {
        for (int e = 0; e < experts; ++e) slot_of[src * experts + e] = e < 8 && src == 1 ? experts + e : e;
      }
      const DeviceBuffer x = to_device(x_bits), w = to_device(w_bits), d_slot_of = to_device(slot_of);
      RouteOutputs two = make_outputs(tokens, experts, top_k, slots), one = make_outputs(tokens, experts, top_k, slots);
      ASSERT_EQ(gpu::launch_skinny_gemm(x.as<uint16_t>(), w.as<uint16_t>(), tokens, experts, hidden,
                                        two.logits.as<float>(), nullptr, nullptr),
                cudaSuccess);
      ASSERT_EQ(cuda::moe::launch_small_route_permute(
                    args_for(two, tokens, experts, top_k, sources, d_slot_of.as<int32_t>()), slots,
                    two.counts.as<int32_t>(), two.offsets.as<int32_t>(), two.entry_row.as<int32_t>(),
                    two.row_token.as<int32_t>(), two.active.as<int32_t>(), nullptr),
                cudaSuccess);
      ASSERT_EQ(cuda::moe::launch_router_route_cluster(
                    x.as<uint16_t>(), w.as<uint16_t>(), hidden, one.logits.as<float>(),
                    args_for(one, tokens, experts, top_k, sources, d_slot_of.as<int32_t>()), slots,
                    one.counts.as<int32_t>(), one.offsets.as<int32_t>(), one.entry_row.as<int32_t>(),
                    one.row_token.as<int32_t>(), one.active.as<int32_t>(), nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const int entries = tokens * top_k;
      EXPECT_TRUE(bitwise_equal(to_host(one.logits.as<float>(), tokens * experts),
                                to_host(two.logits.as<float>(), tokens * experts)));
      EXPECT_EQ(to_host(one.ids.as<int32_t>(), entries), to_host(two.ids.as<int32_t>(), entries));
      EXPECT_TRUE(bitwise_equal(to_host(one.weights.as<float>(), entries), to_host(two.weights.as<float>(), entries)));
      EXPECT_EQ(to_host(one.slot.as<int32_t>(), entries), to_host(two.slot.as<int32_t>(), entries));
      EXPECT_EQ(to_host(one.counts.as<int32_t>(), slots), to_host(two.counts.as<int32_t>(), slots));
      EXPECT_EQ(to_host(one.offsets.as<int32_t>(), slots + 1), to_host(two.offsets.as<int32_t>(), slots + 1));
      EXPECT_EQ(to_host(one.entry_row.as<int32_t>(), entries), to_host(two.entry_row.as<int32_t>(), entries));
      EXPECT_EQ(to_host(one.row_token.as<int32_t>(), entries), to_host(two.row_token.as<int32_t>(), entries));
      const int active = to_host(two.active.as<int32_t>(), 1)[0];
      EXPECT_GT(active, 0);
      EXPECT_EQ(to_host(one.active.as<int32_t>(), active + 1), to_host(two.active.as<int32_t>(), active + 1));
      const std::vector<unsigned long long> hist = to_host(two.histogram.as<unsigned long long>(), experts);
      EXPECT_EQ(to_host(one.histogram.as<unsigned long long>(), experts), hist);
      EXPECT_EQ(std::accumulate(hist.begin(), hist.end(), 0ull), static_cast<unsigned long long>(entries));
    }
  }
}

TEST(RouterRouteClusterTest, RefusesWhatItDoesNotCover) {
  EXPECT_FALSE(cuda::moe::router_route_cluster_fits(0, 128, 8, 2048, 136));
  EXPECT_FALSE(cuda::moe::router_route_cluster_fits(cuda::moe::kRouterClusterMaxTokens + 1, 128, 8, 2048, 136));
  EXPECT_FALSE(cuda::moe::router_route_cluster_fits(1, cuda::moe::kMaxRouterExperts + 1, 8, 2048, 136));
  EXPECT_FALSE(cuda::moe::router_route_cluster_fits(1, 128, 8, 2044, 136));  // hidden % 8 != 0
  cuda::moe::RouterArgs dynamic;  // no static slots: refused
  dynamic.num_tokens = 1;
  dynamic.top_k = 8;
  dynamic.num_experts = 128;
  const DeviceBuffer x(2 * 2048), w(2 * 128 * 2048), logits(4 * 128);
  EXPECT_EQ(cuda::moe::launch_router_route_cluster(x.as<uint16_t>(), w.as<uint16_t>(), 2048, logits.as<float>(),
                                                   dynamic, 136, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace fulcrum::test
