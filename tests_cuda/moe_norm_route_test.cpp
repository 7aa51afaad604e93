// The post-attention norm, router logits and route in one launch (cuda::moe::launch_norm_router_route) against the
// three launches it replaces (gpu::launch_add_rms_norm, gpu::launch_skinny_gemm, launch_small_route_permute), bit
// for bit: the normed rows, the logits, the routing (experts, weights, slots), the recorder histogram and the
// permutation plan; the normed rows also against the CPU reference (reference::add_rms_norm: within one bf16
// step, as the add + RMSNorm kernel's own test, since the double sums of squares run in another order). Twice in a row (the block
// count must come back to zero), at the Qwen3-30B-A3B and -235B-A22B hidden sizes (1..4 and 1..2 tokens), with replicas.
#include <numeric>
#include <random>
#include <vector>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/kernels/skinny_gemm.hpp"
#include "gpu/kernels/step_ops.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "gpu/moe/norm_router_route.hpp"
#include "gpu/reference/step_ops_reference.hpp"
#include "moe_cuda_test_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;

class MoeNormRouteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// Every output of the front of the MoE layer.
struct Front {
  Front(int tokens, int hidden, int experts, int top_k, int slots)
      : x(2 * tokens * hidden), logits(4 * tokens * experts), ids(4 * tokens * top_k), weights(4 * tokens * top_k),
        slot(4 * tokens * top_k), counts(4 * slots), offsets(4 * (slots + 1)), entry_row(4 * tokens * top_k),
        row_token(4 * tokens * top_k), active(4 * (tokens * top_k + 1)), histogram(8 * experts) {
    EXPECT_EQ(cudaMemset(histogram.as<unsigned long long>(), 0, 8 * experts), cudaSuccess);
  }
  DeviceBuffer x, logits, ids, weights, slot, counts, offsets, entry_row, row_token, active, histogram;
};

TEST_F(MoeNormRouteTest, OneLaunchGivesTheThreeLaunchesBits) {
  const int experts = 128, top_k = 8, slots = 136, sources = 2;
  const float eps = 1e-6f;
  for (const int hidden : {2048, 4096}) {
    for (int tokens = 1; tokens <= cuda::moe::kNormRouterRouteMaxTokens; ++tokens) {
      SCOPED_TRACE(fmt::format("hidden {} tokens {}", hidden, tokens));
      // Rows held in registers: 4096-wide rows only up to 2 tokens.
      const bool supported = cuda::moe::norm_router_route_supported(tokens, top_k, hidden, experts, slots);
      ASSERT_EQ(supported, hidden == 2048 || tokens <= 2);
      if (!supported) continue;
      const int64_t rows = int64_t{tokens} * hidden;
      std::mt19937 rng(static_cast<uint32_t>(hidden + tokens));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> residual(static_cast<size_t>(rows)), delta(static_cast<size_t>(rows));
      for (auto& v : residual) v = normal(rng);
      for (auto& v : delta) v = 0.5f * normal(rng);
      const std::vector<uint16_t> norm_weight = to_bits(random_bf16_values(hidden, 7, 1.0f));
      const std::vector<uint16_t> router = to_bits(random_bf16_values(int64_t{experts} * hidden, 8, 0.1f));
      std::vector<int32_t> slot_of(static_cast<size_t>(sources) * experts);  // source 1: replicas of experts 0..7
      for (int src = 0; src < sources; ++src) {
        for (int e = 0; e < experts; ++e) slot_of[src * experts + e] = e < 8 && src == 1 ? experts + e : e;
      }
      const DeviceBuffer d_delta = to_device(delta), d_norm = to_device(norm_weight), d_router = to_device(router),
                         d_slot_of = to_device(slot_of);
      DeviceBuffer d_residual_three = to_device(residual);
      const DeviceBuffer d_residual_one = to_device(residual);
      DeviceBuffer done = to_device(std::vector<uint32_t>{0});
      const auto route_args = [&](Front& f) {
        cuda::moe::RouterArgs a;
        a.logits = f.logits.as<float>();
        a.num_tokens = tokens;
        a.num_experts = experts;
        a.top_k = top_k;
        a.tokens_per_source = (tokens + sources - 1) / sources;
        a.static_slot_of = d_slot_of.as<int32_t>();
        a.expert_ids = f.ids.as<int32_t>();
        a.weights = f.weights.as<float>();
        a.slots = f.slot.as<int32_t>();
        a.histogram = f.histogram.as<unsigned long long>();
        return a;
      };
      Front three(tokens, hidden, experts, top_k, slots), one(tokens, hidden, experts, top_k, slots);
      ASSERT_EQ(gpu::launch_add_rms_norm(d_residual_three.as<float>(), d_delta.as<float>(), d_norm.as<uint16_t>(), eps,
                                         nullptr, tokens, hidden, three.x.as<uint16_t>(), nullptr),
                cudaSuccess);
      ASSERT_EQ(gpu::launch_skinny_gemm(three.x.as<uint16_t>(), d_router.as<uint16_t>(), tokens, experts, hidden,
                                        three.logits.as<float>(), nullptr, nullptr),
                cudaSuccess);
      ASSERT_EQ(cuda::moe::launch_small_route_permute(route_args(three), slots, three.counts.as<int32_t>(),
                                                      three.offsets.as<int32_t>(), three.entry_row.as<int32_t>(),
                                                      three.row_token.as<int32_t>(), three.active.as<int32_t>(), nullptr),
                cudaSuccess);
      cuda::moe::NormRouterRouteArgs a;
      a.residual = d_residual_one.as<float>();
      a.delta = d_delta.as<float>();
      a.norm_weight = d_norm.as<uint16_t>();
      a.eps = eps;
      a.hidden = hidden;
      a.x_out = one.x.as<uint16_t>();
      a.router = d_router.as<uint16_t>();
      a.route = route_args(one);
      a.num_slots = slots;
      a.slot_counts = one.counts.as<int32_t>();
      a.offsets = one.offsets.as<int32_t>();
      a.entry_row = one.entry_row.as<int32_t>();
      a.row_token = one.row_token.as<int32_t>();
      a.active = one.active.as<int32_t>();
      a.done_count = done.as<uint32_t>();
      // Twice: the second launch routes again only if the first left its count at zero (the histogram doubles).
      for (int launch = 0; launch < 2; ++launch) ASSERT_EQ(cuda::moe::launch_norm_router_route(a, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(to_host(done.as<uint32_t>(), 1)[0], 0u);

      const int entries = tokens * top_k;
      const std::vector<uint16_t> x = to_host(one.x.as<uint16_t>(), rows);
      EXPECT_EQ(x, to_host(three.x.as<uint16_t>(), rows));
      std::vector<float> ref_residual = residual;
      std::vector<uint16_t> ref_x(static_cast<size_t>(rows));
      gpu::reference::add_rms_norm(ref_residual, delta, norm_weight, eps, {}, hidden, ref_x);
      int64_t off_by_more = 0;  // bf16 bits of one sign order as integers: one step apart is a difference of 1
      for (size_t q = 0; q < x.size(); ++q) {
        const int d = static_cast<int>(x[q]) - static_cast<int>(ref_x[q]);
        if ((x[q] >> 15) != (ref_x[q] >> 15) || d > 1 || d < -1) ++off_by_more;
      }
      EXPECT_EQ(off_by_more, 0);
      EXPECT_EQ(to_host(d_residual_one.as<float>(), rows), residual);  // not written: the combine adds delta
      EXPECT_EQ(to_host(d_residual_three.as<float>(), rows), ref_residual);
      EXPECT_EQ(to_host(one.logits.as<float>(), int64_t{tokens} * experts),
                to_host(three.logits.as<float>(), int64_t{tokens} * experts));
      EXPECT_EQ(to_host(one.ids.as<int32_t>(), entries), to_host(three.ids.as<int32_t>(), entries));
      EXPECT_EQ(to_host(one.weights.as<float>(), entries), to_host(three.weights.as<float>(), entries));
      EXPECT_EQ(to_host(one.slot.as<int32_t>(), entries), to_host(three.slot.as<int32_t>(), entries));
      EXPECT_EQ(to_host(one.counts.as<int32_t>(), slots), to_host(three.counts.as<int32_t>(), slots));
      EXPECT_EQ(to_host(one.offsets.as<int32_t>(), slots + 1), to_host(three.offsets.as<int32_t>(), slots + 1));
      EXPECT_EQ(to_host(one.entry_row.as<int32_t>(), entries), to_host(three.entry_row.as<int32_t>(), entries));
      EXPECT_EQ(to_host(one.row_token.as<int32_t>(), entries), to_host(three.row_token.as<int32_t>(), entries));
      const int active = to_host(three.active.as<int32_t>(), 1)[0];
      EXPECT_GT(active, 0);
      EXPECT_EQ(to_host(one.active.as<int32_t>(), active + 1), to_host(three.active.as<int32_t>(), active + 1));
      std::vector<unsigned long long> twice = to_host(three.histogram.as<unsigned long long>(), experts);
      for (auto& c : twice) c *= 2;
      EXPECT_EQ(to_host(one.histogram.as<unsigned long long>(), experts), twice);
      EXPECT_EQ(std::accumulate(twice.begin(), twice.end(), 0ull), 2ull * static_cast<unsigned long long>(entries));
    }
  }
}

TEST_F(MoeNormRouteTest, RefusesWhatItCannotRun) {
  EXPECT_FALSE(cuda::moe::norm_router_route_supported(5, 8, 2048, 128, 128));  // 5 tokens
  EXPECT_FALSE(cuda::moe::norm_router_route_supported(4, 16, 2048, 128, 128));  // 64 entries: past the 128-thread plan
  EXPECT_FALSE(cuda::moe::norm_router_route_supported(1, 8, 2044, 128, 128));  // hidden % 8
  EXPECT_FALSE(cuda::moe::norm_router_route_supported(1, 8, 2048, 512, 512));  // experts past the router's bound
  cuda::moe::NormRouterRouteArgs a;  // a supported shape without buffers
  a.hidden = 2048;
  a.route.num_tokens = 1;
  a.route.num_experts = 128;
  a.route.top_k = 8;
  a.num_slots = 128;
  EXPECT_EQ(cuda::moe::launch_norm_router_route(a, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace fulcrum::test
