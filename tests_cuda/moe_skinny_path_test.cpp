// The MoE layer's skinny path for small steps (T x k <= kDefaultSkinnyMaxEntries on a layer holding all its
// slots): the one-launch permutation (cuda::moe::launch_small_permutation) against a host counting sort, the
// expert skinny GEMMs (gpu::launch_expert_skinny_gemm) against the CPU reference (reference::skinny_gemm, plus
// the bf16 roundings of the unfused path), and the whole layer against the bf16 reference and against its own
// CUTLASS path.
//
// Tolerances and why:
//   exact      slot counts, offsets, entry rows (a slot's entries in entry order), row tokens, the active list;
//              a row's expert output computed with other rows or alone (the arithmetic is per row), and with W
//              by register loads (the default for bf16) or by bulk copies
//   1e-3       expert rows and the layer output vs the bf16 references and vs the CUTLASS path,
//              ||gpu - ref|| / ||ref|| (kBf16Tolerance: the same bf16 roundings, fp32 sums in another order)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "gpu/kernels/expert_skinny_gemm.hpp"
#include "gpu/reference/skinny_gemm_reference.hpp"
#include "model/moe_reference.hpp"
#include "moe_cuda_test_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using backend::GpuMoeLayer;
namespace moe = model::moe;

class MoeSkinnyPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the GPU MoE tests need a GPU";
  }
};

float bf16_round(float v) { return to_floats(to_bits({v}))[0]; }

// Expected output rows of the expert skinny GEMM: row r of slot s = f(x[source[r]] . W_s).
std::vector<float> expected_rows(const std::vector<uint16_t>& x, const std::vector<int32_t>& source,
                                 const std::vector<int32_t>& offsets, const std::vector<std::vector<uint16_t>>& weights,
                                 int n, int k, bool swiglu) {
  const int rows = offsets.back();
  std::vector<float> out(static_cast<size_t>(rows) * n);
  const int w_rows = swiglu ? 2 * n : n;
  std::vector<float> y(static_cast<size_t>(w_rows));
  for (size_t s = 0; s + 1 < offsets.size(); ++s) {
    for (int r = offsets[s]; r < offsets[s + 1]; ++r) {
      const std::span<const uint16_t> xr(x.data() + static_cast<size_t>(source[r]) * k, static_cast<size_t>(k));
      gpu::reference::skinny_gemm(xr, weights[s], 1, w_rows, k, y);
      for (int j = 0; j < n; ++j) {
        float v = y[j];
        if (swiglu) {
          const float g = bf16_round(y[j]), u = bf16_round(y[n + j]);
          v = g / (1.0f + std::exp(-g)) * u;
        }
        out[static_cast<size_t>(r) * n + j] = bf16_round(v);
      }
    }
  }
  return out;
}

// One launch gives what a host counting sort gives, for slot counts beyond one block's scan (P = 1500) and the
// largest small step (1024 entries).
TEST_F(MoeSkinnyPathTest, SmallPermutationMatchesHostCountingSort) {
  for (const auto& [entries, slots, top_k] : {std::tuple{1, 16, 1}, std::tuple{8, 136, 8}, std::tuple{37, 20, 1},
                                             std::tuple{128, 128, 8}, std::tuple{1024, 1500, 8}, std::tuple{0, 16, 8}}) {
    SCOPED_TRACE(fmt::format("entries {} slots {} top-k {}", entries, slots, top_k));
    std::mt19937 rng(static_cast<uint32_t>(entries * 31 + slots));
    std::vector<int32_t> slot_of(static_cast<size_t>(entries));
    // Skewed: half the entries on the first few slots, so some slots get many rows and most get none.
    for (auto& s : slot_of) s = rng() % 2 == 0 ? static_cast<int32_t>(rng() % 3) : static_cast<int32_t>(rng() % slots);
    const DeviceBuffer d_slots = to_device(slot_of.empty() ? std::vector<int32_t>{0} : slot_of);
    DeviceBuffer counts(sizeof(int32_t) * slots), offsets(sizeof(int32_t) * (slots + 1)),
        entry_row(sizeof(int32_t) * std::max(entries, 1)), row_token(sizeof(int32_t) * std::max(entries, 1)),
        active(sizeof(int32_t) * (entries + 1));
    ASSERT_EQ(cuda::moe::launch_small_permutation(d_slots.as<int32_t>(), entries, top_k, slots, counts.as<int32_t>(),
                                                  offsets.as<int32_t>(), entry_row.as<int32_t>(),
                                                  row_token.as<int32_t>(), active.as<int32_t>(), nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    std::vector<int32_t> want_counts(static_cast<size_t>(slots), 0), want_offsets(static_cast<size_t>(slots) + 1, 0);
    for (const int32_t s : slot_of) ++want_counts[s];
    std::partial_sum(want_counts.begin(), want_counts.end(), want_offsets.begin() + 1);
    std::vector<int32_t> cursor(want_offsets.begin(), want_offsets.end() - 1), want_row(slot_of.size()),
        want_token(slot_of.size());
    for (size_t e = 0; e < slot_of.size(); ++e) {
      want_row[e] = cursor[slot_of[e]]++;
      want_token[want_row[e]] = static_cast<int32_t>(e) / top_k;
    }
    std::vector<int32_t> want_active{0};
    for (int s = 0; s < slots; ++s) {
      if (want_counts[s] > 0) want_active.push_back(s);
    }
    want_active[0] = static_cast<int32_t>(want_active.size()) - 1;
    EXPECT_EQ(to_host(counts.as<int32_t>(), slots), want_counts);
    EXPECT_EQ(to_host(offsets.as<int32_t>(), slots + 1), want_offsets);
    EXPECT_EQ(to_host(entry_row.as<int32_t>(), entries), want_row);
    EXPECT_EQ(to_host(row_token.as<int32_t>(), entries), want_token);
    EXPECT_EQ(to_host(active.as<int32_t>(), static_cast<int64_t>(want_active.size())), want_active);
  }
  EXPECT_EQ(cuda::moe::launch_small_permutation(nullptr, cuda::moe::kSmallPlanMaxEntries + 1, 8, 16, nullptr, nullptr,
                                                nullptr, nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
}

// The fused router + permutation (static replicas) gives the two launches' outputs bit for bit: routing
// (experts, weights, slots), the recorder histogram, and the permutation, from 1 token to the largest small step
// (1 to 4 tokens: the one-warp permutation, 136 slots in five chunks of 32; 37 and 128: the block's scans).
TEST_F(MoeSkinnyPathTest, FusedRoutePermuteEqualsTheTwoLaunches) {
  const int experts = 128, top_k = 8, slots = 136, sources = 2;
  for (const int tokens : {1, 2, 3, 4, 37, 128}) {
    SCOPED_TRACE(fmt::format("tokens {}", tokens));
    std::mt19937 rng(static_cast<uint32_t>(tokens));
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<float> logits(static_cast<size_t>(tokens) * experts);
    for (auto& v : logits) v = normal(rng);
    std::vector<int32_t> slot_of(static_cast<size_t>(sources) * experts);  // source s: expert e -> a replica
    for (int src = 0; src < sources; ++src) {
      for (int e = 0; e < experts; ++e) slot_of[src * experts + e] = e < 8 && src == 1 ? experts + e : e;
    }
    const DeviceBuffer d_logits = to_device(logits), d_slot_of = to_device(slot_of);
    const int entries = tokens * top_k;
    struct Outputs {
      DeviceBuffer ids, weights, slot, counts, offsets, entry_row, row_token, active, histogram;
    };
    const auto make = [&] {
      Outputs o{DeviceBuffer(4 * entries), DeviceBuffer(4 * entries), DeviceBuffer(4 * entries), DeviceBuffer(4 * slots),
                DeviceBuffer(4 * (slots + 1)), DeviceBuffer(4 * entries), DeviceBuffer(4 * entries),
                DeviceBuffer(4 * (entries + 1)), DeviceBuffer(8 * experts)};
      EXPECT_EQ(cudaMemset(o.histogram.as<unsigned long long>(), 0, 8 * experts), cudaSuccess);
      return o;
    };
    const auto args_for = [&](Outputs& o) {
      cuda::moe::RouterArgs a;
      a.logits = d_logits.as<float>();
      a.num_tokens = tokens;
      a.num_experts = experts;
      a.top_k = top_k;
      a.tokens_per_source = (tokens + sources - 1) / sources;
      a.static_slot_of = d_slot_of.as<int32_t>();
      a.expert_ids = o.ids.as<int32_t>();
      a.weights = o.weights.as<float>();
      a.slots = o.slot.as<int32_t>();
      a.histogram = o.histogram.as<unsigned long long>();
      return a;
    };
    Outputs two = make(), one = make();
    ASSERT_EQ(cuda::moe::launch_moe_router(args_for(two), nullptr), cudaSuccess);
    ASSERT_EQ(cuda::moe::launch_small_permutation(two.slot.as<int32_t>(), entries, top_k, slots, two.counts.as<int32_t>(),
                                                  two.offsets.as<int32_t>(), two.entry_row.as<int32_t>(),
                                                  two.row_token.as<int32_t>(), two.active.as<int32_t>(), nullptr),
              cudaSuccess);
    ASSERT_EQ(cuda::moe::launch_small_route_permute(args_for(one), slots, one.counts.as<int32_t>(),
                                                    one.offsets.as<int32_t>(), one.entry_row.as<int32_t>(),
                                                    one.row_token.as<int32_t>(), one.active.as<int32_t>(), nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(to_host(one.ids.as<int32_t>(), entries), to_host(two.ids.as<int32_t>(), entries));
    EXPECT_EQ(to_host(one.weights.as<float>(), entries), to_host(two.weights.as<float>(), entries));
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
  cuda::moe::RouterArgs dynamic;  // no static slots: refused
  dynamic.num_tokens = 1;
  dynamic.top_k = 8;
  dynamic.num_experts = 128;
  EXPECT_EQ(cuda::moe::launch_small_route_permute(dynamic, 16, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
}

// Both GEMMs over slots with 19, 0 and 5 rows (19: three passes of 8, 8 and 3 rows) at the Qwen3-30B-A3B expert
// shape, against the reference; a row computed alone gives the same bits as with 18 others.
TEST_F(MoeSkinnyPathTest, ExpertGemmsMatchReferenceAndArePerRow) {
  const int h = 2048, i = 768, tokens = 24;
  const std::vector<int32_t> offsets{0, 19, 19, 24};
  std::mt19937 rng(5);
  std::vector<int32_t> source(24);
  for (auto& s : source) s = static_cast<int32_t>(rng() % tokens);
  const std::vector<uint16_t> x = to_bits(random_bf16_values(int64_t{tokens} * h, 6, 1.0f));
  std::vector<std::vector<uint16_t>> gate_up, down;
  std::vector<DeviceBuffer> d_gate_up, d_down;
  std::vector<const uint16_t*> gate_up_ptrs, down_ptrs;
  for (int s = 0; s < 3; ++s) {
    gate_up.push_back(to_bits(random_bf16_values(int64_t{2} * i * h, 10 + s, 1.0f / std::sqrt(float(h)))));
    down.push_back(to_bits(random_bf16_values(int64_t{h} * i, 20 + s, 1.0f / std::sqrt(float(i)))));
    d_gate_up.push_back(to_device(gate_up.back()));
    d_down.push_back(to_device(down.back()));
    gate_up_ptrs.push_back(d_gate_up.back().as<uint16_t>());
    down_ptrs.push_back(d_down.back().as<uint16_t>());
  }
  const DeviceBuffer d_x = to_device(x), d_source = to_device(source), d_offsets = to_device(offsets),
                     d_active = to_device(std::vector<int32_t>{2, 2, 0}), d_gate_up_ptrs = to_device(gate_up_ptrs),
                     d_down_ptrs = to_device(down_ptrs);
  DeviceBuffer act(sizeof(uint16_t) * 24 * i), out(sizeof(uint16_t) * 24 * h);
  const ExpertGemms gemms = expert_gemms(d_x.as<uint16_t>(), d_source.as<int32_t>(), d_offsets.as<int32_t>(),
                                         d_active.as<int32_t>(), d_gate_up_ptrs, d_down_ptrs, h, i, 24, 3,
                                         act.as<uint16_t>(), out.as<uint16_t>());
  gpu::ExpertSkinnyArgs a = gemms.gate_up, b = gemms.down;
  ASSERT_EQ(gpu::launch_expert_skinny_gemm(a, nullptr), cudaSuccess);
  ASSERT_EQ(gpu::launch_expert_skinny_gemm(b, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> act_bits = to_host(act.as<uint16_t>(), 24 * i);
  const std::vector<float> act_ref = expected_rows(x, source, offsets, gate_up, i, h, true);
  const double act_error = relative_error(to_floats(act_bits), act_ref);
  EXPECT_LE(act_error, kBf16Tolerance);
  std::vector<int32_t> identity(24);
  std::iota(identity.begin(), identity.end(), 0);
  const std::vector<float> out_ref = expected_rows(act_bits, identity, offsets, down, h, i, false);
  const std::vector<uint16_t> out_bits = to_host(out.as<uint16_t>(), 24 * h);
  const double out_error = relative_error(to_floats(out_bits), out_ref);
  EXPECT_LE(out_error, kBf16Tolerance);
  fmt::print("  expert skinny GEMMs: gate_up + SwiGLU rel err {:.2e}, down rel err {:.2e}\n", act_error, out_error);

  // Row 7 alone (slot 0 holding one row, its token): the same bits as among slot 0's 19 rows.
  const DeviceBuffer one_offsets = to_device(std::vector<int32_t>{0, 1, 1, 1}),
                     one_active = to_device(std::vector<int32_t>{1, 0}),
                     one_source = to_device(std::vector<int32_t>{source[7]});
  DeviceBuffer one_act(sizeof(uint16_t) * i);
  gpu::ExpertSkinnyArgs c = a;
  c.row_source = one_source.as<int32_t>();
  c.offsets = one_offsets.as<int32_t>();
  c.active = one_active.as<int32_t>();
  c.out = one_act.as<uint16_t>();
  ASSERT_EQ(gpu::launch_expert_skinny_gemm(c, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(to_host(one_act.as<uint16_t>(), i), std::vector<uint16_t>(act_bits.begin() + 7 * i, act_bits.begin() + 8 * i));

  // Both GEMMs in one kernel variant (slots of at most `bound` rows: 1-row chunks and 8 W rows per warp, ...; 0:
  // max_rows), W loads and plan timing (the down GEMM reading its plan and first weights before its wait), launched
  // one after the other on one stream as GpuMoeLayer does; the activations and the outputs.
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto run_variant = [&](int bound, gpu::SkinnyWeightLoads loads, bool early) {
    gpu::ExpertSkinnyArgs va = a, vb = b;
    va.max_slot_rows = vb.max_slot_rows = bound;
    va.loads = vb.loads = loads;
    vb.plan_ready_early = early;
    DeviceBuffer v_act(sizeof(uint16_t) * 24 * i), v_out(sizeof(uint16_t) * 24 * h);
    va.out = v_act.as<uint16_t>();
    vb.x = v_act.as<uint16_t>();
    vb.out = v_out.as<uint16_t>();
    EXPECT_EQ(gpu::launch_expert_skinny_gemm(va, stream), cudaSuccess);
    EXPECT_EQ(gpu::launch_expert_skinny_gemm(vb, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return std::make_pair(to_host(v_act.as<uint16_t>(), 24 * i), to_host(v_out.as<uint16_t>(), 24 * h));
  };
  // Every variant gives the same bits, even though slot 0 holds 19 rows, past the bounds; so do W by bulk copies into
  // shared memory and by register loads (the default takes either, by GEMM and rows), with and without the early plan.
  for (const int bound : {0, 1, 2, 4}) {
    for (const auto loads : {gpu::SkinnyWeightLoads::kAuto, gpu::SkinnyWeightLoads::kRegisters,
                             gpu::SkinnyWeightLoads::kBulk}) {
      for (const bool early : {false, true}) {
        const auto [v_act, v_out] = run_variant(bound, loads, early);
        const std::string what = fmt::format("max_slot_rows {}, loads {}{}", bound, static_cast<int>(loads),
                                             early ? ", early plan" : "");
        EXPECT_EQ(v_act, act_bits) << what;
        EXPECT_EQ(v_out, out_bits) << what;
      }
    }
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);

  a.k = 100;  // not a multiple of 8
  EXPECT_EQ(gpu::launch_expert_skinny_gemm(a, nullptr), cudaErrorInvalidValue);
}

// Many slots at the Qwen3-30B-A3B expert shape (64 slots of 2 rows: 6144 gate_up items and 8192 down items, more
// than a grid holds, so bulk blocks take several items each, refill their stages and flip their barriers' phases;
// the down GEMM's 24 KB items get two stages): bulk copies give the register loads' bits, with and without the
// early plan. Which stage count the host picks follows the device's occupancy; the items per block do not.
TEST_F(MoeSkinnyPathTest, BulkCopiesOverManyItemsGiveTheRegisterLoadsBits) {
  const int h = 2048, i = 768, slots = 64, rows_per_slot = 2, rows = slots * rows_per_slot, tokens = 16;
  std::mt19937 rng(17);
  std::vector<int32_t> offsets(slots + 1), active(slots + 1), source(rows);
  for (int s = 0; s <= slots; ++s) offsets[s] = s * rows_per_slot;
  active[0] = slots;
  for (int s = 0; s < slots; ++s) active[1 + s] = slots - 1 - s;  // any order
  for (auto& src : source) src = static_cast<int32_t>(rng() % tokens);
  const DeviceBuffer d_x = to_device(to_bits(random_bf16_values(int64_t{tokens} * h, 31, 1.0f)));
  // One gate_up and one down matrix shared by every slot keeps the upload small; the items still differ by rows.
  const DeviceBuffer d_gate_up = to_device(to_bits(random_bf16_values(int64_t{2} * i * h, 32, 1.0f / 45.0f)));
  const DeviceBuffer d_down = to_device(to_bits(random_bf16_values(int64_t{h} * i, 33, 1.0f / 28.0f)));
  const std::vector<const uint16_t*> gate_up_ptrs(slots, d_gate_up.as<uint16_t>());
  const std::vector<const uint16_t*> down_ptrs(slots, d_down.as<uint16_t>());
  const DeviceBuffer d_source = to_device(source), d_offsets = to_device(offsets), d_active = to_device(active),
                     d_gate_up_ptrs = to_device(gate_up_ptrs), d_down_ptrs = to_device(down_ptrs);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto run = [&](gpu::SkinnyWeightLoads loads, bool early) {
    DeviceBuffer act(sizeof(uint16_t) * rows * i), out(sizeof(uint16_t) * rows * h);
    ExpertGemms gemms = expert_gemms(d_x.as<uint16_t>(), d_source.as<int32_t>(), d_offsets.as<int32_t>(),
                                     d_active.as<int32_t>(), d_gate_up_ptrs, d_down_ptrs, h, i, rows, slots,
                                     act.as<uint16_t>(), out.as<uint16_t>());
    gpu::ExpertSkinnyArgs& a = gemms.gate_up;
    gpu::ExpertSkinnyArgs& b = gemms.down;
    a.max_slot_rows = b.max_slot_rows = rows_per_slot;
    a.loads = b.loads = loads;
    b.plan_ready_early = early;
    EXPECT_EQ(cudaMemsetAsync(act.as<uint16_t>(), 0xff, sizeof(uint16_t) * rows * i, stream), cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(out.as<uint16_t>(), 0xff, sizeof(uint16_t) * rows * h, stream), cudaSuccess);
    EXPECT_EQ(gpu::launch_expert_skinny_gemm(a, stream), cudaSuccess);
    EXPECT_EQ(gpu::launch_expert_skinny_gemm(b, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return std::make_pair(to_host(act.as<uint16_t>(), rows * i), to_host(out.as<uint16_t>(), rows * h));
  };
  const auto [act_regs, out_regs] = run(gpu::SkinnyWeightLoads::kRegisters, false);
  EXPECT_EQ(std::count(act_regs.begin(), act_regs.end(), uint16_t{0xffff}), 0) << "activations left unwritten";
  EXPECT_EQ(std::count(out_regs.begin(), out_regs.end(), uint16_t{0xffff}), 0) << "outputs left unwritten";
  for (const bool early : {false, true}) {
    const auto [act_bulk, out_bulk] = run(gpu::SkinnyWeightLoads::kBulk, early);
    EXPECT_EQ(act_bulk, act_regs) << (early ? "early plan" : "plan after the wait");
    EXPECT_EQ(out_bulk, out_regs) << (early ? "early plan" : "plan after the wait");
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The layer on the skinny path (up to 136 entries, past the default bound) vs the bf16 reference and vs its
// CUTLASS path (set_skinny_max_entries(0)), for every replica choice; by default the path is taken up to the
// entry bound and not above it.
TEST_F(MoeSkinnyPathTest, LayerMatchesReferenceAndCutlassPath) {
  struct Case {
    int hidden, intermediate, experts, top_k, extra;
    int64_t tokens;
  };
  for (const Case c : {Case{2048, 768, 16, 4, 4, 1}, Case{2048, 768, 16, 4, 4, 32}, Case{4096, 1536, 16, 4, 4, 3},
                       Case{64, 48, 128, 8, 8, 16}, Case{64, 48, 128, 8, 8, 17}}) {
    const int p = c.experts + c.extra;
    const std::vector<int32_t> map = layer_map_for(c.experts, c.extra, 41);
    const MoeWeights w = random_moe_weights(c.hidden, c.intermediate, c.experts, map, 42);
    GpuMoeLayer layer(moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, p, c.tokens));
    layer.upload_weights(to_bits(w.router), to_bits(w.gate_up), to_bits(w.down));
    EXPECT_EQ(layer.uses_skinny(c.tokens), c.tokens * c.top_k <= backend::kDefaultSkinnyMaxEntries);
    const std::vector<float> x = random_bf16_values(c.tokens * c.hidden, 43, 1.0f);
    const DeviceBuffer d_x = to_device(to_bits(x));
    DeviceBuffer d_out(sizeof(float) * c.tokens * c.hidden);
    for (const auto algorithm : {eplb::DispatchAlgorithm::kStatic, eplb::DispatchAlgorithm::kDynamic,
                                 eplb::DispatchAlgorithm::kBalanced}) {
      SCOPED_TRACE(fmt::format("H{} I{} E{} k{} T{} {}", c.hidden, c.intermediate, c.experts, c.top_k, c.tokens,
                               eplb::to_string(algorithm)));
      const eplb::Topology topo{p, 1, 1};
      const moe::ReplicaChoiceSpec spec = moe::make_replica_choice(
          algorithm, map, c.experts, topo, c.tokens,
          algorithm == eplb::DispatchAlgorithm::kDynamic ? std::vector<uint64_t>{0x5eedull} : std::vector<uint64_t>{});
      layer.set_replica_choice(spec);
      layer.set_skinny_max_entries(cuda::moe::kSmallPlanMaxEntries);  // every case here, past the default bound
      EXPECT_TRUE(layer.uses_skinny(c.tokens));
      layer.forward(d_x.as<uint16_t>(), c.tokens, d_out.as<float>());
      layer.synchronize();
      const std::vector<float> skinny = to_host(d_out.as<float>(), c.tokens * c.hidden);
      const std::vector<float> logits = to_host(layer.logits(), c.tokens * c.experts);
      const std::vector<float> ref = moe::moe_layer_reference(x, logits, c.tokens, w.gate_up, w.down, c.hidden,
                                                              c.intermediate, c.top_k, true, spec);
      const model::RouterChoice choice = moe::route_reference(logits, c.tokens, c.experts, c.top_k, true);
      const std::span<const int32_t> counts = layer.fetch_slot_counts();
      EXPECT_EQ(std::vector<int32_t>(counts.begin(), counts.end()),
                moe::slot_layout_reference(moe::choose_slots_reference(choice, spec), p).counts);
      layer.set_skinny_max_entries(0);
      EXPECT_FALSE(layer.uses_skinny(c.tokens));
      layer.forward(d_x.as<uint16_t>(), c.tokens, d_out.as<float>());
      layer.synchronize();
      const std::vector<float> cutlass = to_host(d_out.as<float>(), c.tokens * c.hidden);
      const double ref_error = relative_error(skinny, ref), cutlass_error = relative_error(skinny, cutlass);
      EXPECT_LE(ref_error, kBf16Tolerance);
      EXPECT_LE(cutlass_error, kBf16Tolerance);
      fmt::print("  skinny path H{} T{} {}: rel err vs reference {:.2e}, vs CUTLASS path {:.2e}\n", c.hidden, c.tokens,
                 eplb::to_string(algorithm), ref_error, cutlass_error);
    }
  }
}

// Every value the skinny path reads in a step was written in that step (or is a weight): with workspace arrays filled
// with NaN / -1 bytes before each forward (the plan arrays, the SwiGLU rows, the expert rows; each set alone and all
// together, so a failure names what was read early), six forwards of 1, 2 and 4 tokens (the 1-row and chunked
// kernels, the down GEMM reading its plan before its wait) give the unpoisoned forward's output bit for bit, and no
// NaN. A read racing a write of the same step would see the fill.
TEST_F(MoeSkinnyPathTest, StepReadsOnlyWhatItWrote) {
  const int hidden = 2048, intermediate = 768, experts = 128, top_k = 8, extra = 8, p = experts + extra;
  const std::vector<int32_t> map = layer_map_for(experts, extra, 61);
  const MoeWeights w = random_moe_weights(hidden, intermediate, experts, map, 62);
  GpuMoeLayer layer(moe_shape(hidden, intermediate, experts, top_k, p, 4));
  layer.upload_weights(to_bits(w.router), to_bits(w.gate_up), to_bits(w.down));
  backend::MoeWorkspace& ws = *layer.workspace();
  const std::vector<DeviceBuffer*> plan = {&ws.expert_ids, &ws.weights, &ws.slots,     &ws.counts,
                                           &ws.offsets,    &ws.entry_row, &ws.row_token, &ws.active};
  std::vector<DeviceBuffer*> all = plan;
  all.insert(all.end(), {&ws.act, &ws.expert_out});
  const std::vector<std::pair<std::string, std::vector<DeviceBuffer*>>> fills = {
      {"plan", plan}, {"act", {&ws.act}}, {"expert_out", {&ws.expert_out}}, {"all", all}};
  for (const int64_t tokens : {1, 2, 4}) {
    layer.set_replica_choice(moe::make_replica_choice(eplb::DispatchAlgorithm::kStatic, map, experts,
                                                      eplb::Topology{p, 1, 1}, tokens, {}));
    ASSERT_TRUE(layer.uses_skinny(tokens));
    const DeviceBuffer d_x = to_device(to_bits(random_bf16_values(tokens * hidden, 63, 1.0f)));
    DeviceBuffer d_out(sizeof(float) * tokens * hidden);
    const auto forward = [&]() {
      layer.forward(d_x.as<uint16_t>(), tokens, d_out.as<float>());
      layer.synchronize();
      return to_host(d_out.as<float>(), tokens * hidden);
    };
    const std::vector<float> expected = forward();
    for (const auto& [name, buffers] : fills) {
      for (int round = 0; round < 6; ++round) {
        SCOPED_TRACE(fmt::format("T{} {} filled, round {}", tokens, name, round));
        for (DeviceBuffer* b : buffers) ASSERT_EQ(cudaMemset(b->as<void>(), 0xff, b->bytes()), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<float> out = forward();
        EXPECT_EQ(std::count_if(out.begin(), out.end(), [](float v) { return std::isnan(v); }), 0);
        if (std::memcmp(expected.data(), out.data(), sizeof(float) * out.size()) != 0) {
          // Where the fill came through: NaN bf16 values in the SwiGLU rows and in the expert rows, and the plan.
          const int64_t rows = tokens * top_k;
          const auto nan_bf16 = [](const std::vector<uint16_t>& v) {
            return std::count_if(v.begin(), v.end(), [](uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f); });
          };
          ADD_FAILURE() << fmt::format(
              "output differs from the unfilled forward; NaN values in act {} of {}, in expert rows {} of {}; "
              "active {}, row_token {}, slot offsets {}",
              nan_bf16(to_host(ws.act.as<uint16_t>(), rows * intermediate)), rows * intermediate,
              nan_bf16(to_host(layer.expert_out(), rows * hidden)), rows * hidden,
              fmt::join(to_host(ws.active.as<int32_t>(), 1 + rows), ","),
              fmt::join(to_host(ws.row_token.as<int32_t>(), rows), ","),
              fmt::join(to_host(layer.slot_offsets(), p + 1), ","));
        }
      }
    }
  }
}

}  // namespace
}  // namespace fulcrum::test
