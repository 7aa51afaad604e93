// The FP8 layer's permutation fused with the 1x128 activation quantization (cuda::moe::launch_permute_rows_fp8,
// src/gpu/moe/moe_kernels.hpp, fp8_permute.cu) and its use in GpuMoeLayer (set_fp8_fused_permute,
// FULCRUM_FP8_FUSED_PERMUTE, on by default).
//  - kernel vs its CPU reference, the composition of the existing ones: the permutation (offsets as
//    moe::slot_layout_reference; rows permuted[entry_row[e]] = x[e / k], entry_row checked to give every entry
//    its own row inside its slot) followed by gpu::reference::quantize_rows_fp8 with the slots as groups. Exact:
//    q and scales bitwise equal over the whole buffers, whose poison (0xAA / NaN) past the T * k rows must stay.
//    Exact because the kernel repeats the reference's fp32 operations (amax of bf16 values, one IEEE division
//    each for 448 / amax and amax / 448, one fp32 multiply, e4m3 round to nearest even, saturating), as
//    launch_quantize_rows_fp8 does (gpu_fp8_quant_test.cpp checks that one the same way);
//  - kernel vs the unfused GPU path on the same routing (launch_permute_rows, then launch_quantize_rows_fp8 on
//    its bf16 rows): the row order within a slot follows atomics, so each entry's row is found through each
//    run's own entry_row; its codes and its Kb scales bitwise equal;
//  - shapes: the Qwen3-30B-A3B hidden size 2048 at top-8 with replica slots, an odd block count (H 384: one
//    half-warp does a block more), top-16 (kMaxTopK), one token at top-1; slots drawn with hot ones, empty ones
//    and tokens with two entries in one slot; a zero token row (scale 0, codes 0), blocks near the bf16 maximum,
//    tiny blocks, blocks whose every value is +-amax (+-448) and a block with one non-zero value;
//  - one CUDA-graph capture (slot counts, cursor copy, fused permutation) replayed with other slots, all rows in
//    one slot included: each replay equal to its reference;
//  - the launcher's argument checks;
//  - the layer: the FP8 layer's forward output bitwise equal with the fused permutation on and off (the same
//    codes and scales reach the same GEMMs, and a row's result does not depend on its position in its slot:
//    gpu_fp8_experts_test.cpp's placement test), the fused forward leaves permuted() untouched (so it did take
//    the fused path) and the unfused one writes it; after a fused permute, run_experts over slot sub-ranges gives
//    per entry the bits of the unfused whole stage.
#include <algorithm>
#include <cstring>
#include <numeric>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "eplb/dispatch.hpp"
#include "gpu/kernels/fp8_quant.hpp"
#include "gpu/moe/gpu_slot_pool.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "gpu/reference/fp8_reference.hpp"
#include "model/moe_reference.hpp"
#include "moe_cuda_test_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using backend::GpuMoeLayer;
namespace moe = model::moe;

constexpr int kBlock = gpu::reference::kFp8Block;
constexpr uint8_t kQPoison = 0xAA;
constexpr int kSpareRows = 2;  // rows past T * k in q and scales, which nothing may write

bool on_sm90() {
  if (backend::CudaBackend::device_count() == 0) return false;
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && prop.minor == 0;
}

struct Case {
  int64_t tokens;
  int hidden, top_k, slots;
  int64_t entries() const { return tokens * top_k; }
  int k_blocks() const { return hidden / kBlock; }
  std::string name() const { return fmt::format("T {} H {} k {} P {}", tokens, hidden, top_k, slots); }
};

// Token rows x [T, H] bf16 with the special blocks of the header, and slots [T * k]: 40% of the entries on the
// first 4 slots (hot), the rest uniform over all but the last 2 (empty); a token's entries may share a slot.
struct Routing {
  std::vector<uint16_t> x;
  std::vector<int32_t> slots;
};

Routing make_routing(const Case& c, uint64_t seed) {
  std::vector<float> x = random_bf16_values(c.tokens * c.hidden, seed, 4.0f);
  const int64_t h = c.hidden;
  const auto set_block = [&](int64_t t, int kb, auto value_of) {
    for (int q = 0; q < kBlock; ++q) x[t * h + kb * kBlock + q] = moe::round_bf16(value_of(q));
  };
  if (c.tokens >= 3) {
    std::fill(x.begin(), x.begin() + h, 0.0f);  // token 0: all zeros
    set_block(1, 0, [](int q) { return (q % 2 ? -3.0e38f : 3.0e38f) * (1.0f - q / 512.0f); });  // near bf16 max
    set_block(2, 0, [](int q) { return q % 2 ? -3.0f : 3.0f; });  // every value +-amax: all codes +-448
    if (c.k_blocks() >= 2) {
      set_block(1, c.k_blocks() - 1, [](int q) { return 1.0e-30f * (1.0f + q / 64.0f) * (q % 3 ? 1.0f : -1.0f); });
      set_block(2, 1, [](int q) { return q == 77 ? 1.0f : 0.0f; });  // one non-zero value
    }
  }
  Routing r{to_bits(x), std::vector<int32_t>(static_cast<size_t>(c.entries()))};
  eplb::SplitMix64 rng(seed + 1);
  const int hot = std::min(4, c.slots), used = std::max(c.slots - 2, 1);
  for (int32_t& s : r.slots) {
    s = static_cast<int32_t>(rng.uniform() < 0.4 ? rng.below(static_cast<uint32_t>(hot))
                                                 : rng.below(static_cast<uint32_t>(used)));
  }
  return r;
}

// One run's outputs: offsets [P + 1], entry_row [T * k], q [(T * k + spare) * H], scales [(T * k + spare) * Kb].
struct Fp8Rows {
  std::vector<int32_t> offsets, entry_row;
  std::vector<uint8_t> q;
  std::vector<float> scales;
};

// q and scales of the given length with the poison the GPU runs start from.
Fp8Rows poisoned_rows(const Case& c) {
  const int64_t rows = c.entries() + kSpareRows;
  Fp8Rows r;
  r.q.assign(static_cast<size_t>(rows * c.hidden), kQPoison);
  r.scales.resize(static_cast<size_t>(rows * c.k_blocks()));
  const uint32_t nan_bits = 0xffffffffu;
  for (float& s : r.scales) std::memcpy(&s, &nan_bits, sizeof(s));
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

// Whether entry_row gives every entry its own row inside its slot's range [offsets[s], offsets[s + 1]).
::testing::AssertionResult is_slot_permutation(const std::vector<int32_t>& entry_row, const std::vector<int32_t>& slots,
                                              const std::vector<int32_t>& offsets) {
  std::vector<int> seen(entry_row.size(), 0);
  for (size_t e = 0; e < entry_row.size(); ++e) {
    const int32_t row = entry_row[e], s = slots[e];
    if (row < offsets[s] || row >= offsets[s + 1]) {
      return ::testing::AssertionFailure() << "entry " << e << " of slot " << s << " got row " << row << ", slot rows ["
                                           << offsets[s] << ", " << offsets[s + 1] << ")";
    }
    if (++seen[row] > 1) return ::testing::AssertionFailure() << "row " << row << " taken twice";
  }
  return ::testing::AssertionSuccess();
}

// The CPU reference: the rows the permutation puts where entry_row says, quantized with the slots as groups.
Fp8Rows reference_rows(const Case& c, const Routing& r, const std::vector<int32_t>& offsets,
                       const std::vector<int32_t>& entry_row) {
  const int64_t h = c.hidden;
  std::vector<uint16_t> permuted(static_cast<size_t>((c.entries() + kSpareRows) * h), 0);
  for (int64_t e = 0; e < c.entries(); ++e) {
    std::copy_n(r.x.begin() + (e / c.top_k) * h, h, permuted.begin() + int64_t{entry_row[e]} * h);
  }
  Fp8Rows ref = poisoned_rows(c);
  gpu::reference::quantize_rows_fp8(permuted, c.hidden, offsets, ref.q, ref.scales);
  ref.offsets = offsets;
  ref.entry_row = entry_row;
  return ref;
}

// Entries whose codes or scales differ between two runs, each entry's row taken from its own run.
int64_t entries_differing(const Case& c, const std::vector<int32_t>& slots, const Fp8Rows& a, const Fp8Rows& b) {
  const int64_t h = c.hidden, kb_count = c.k_blocks();
  int64_t differ = 0;
  for (int64_t e = 0; e < c.entries(); ++e) {
    const int64_t ra = a.entry_row[e], rb = b.entry_row[e], s = slots[e];
    const int64_t f = a.offsets[s], m = a.offsets[s + 1] - f;
    bool same = std::memcmp(a.q.data() + ra * h, b.q.data() + rb * h, static_cast<size_t>(h)) == 0;
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      same = same && std::memcmp(&a.scales[f * kb_count + kb * m + (ra - f)], &b.scales[f * kb_count + kb * m + (rb - f)],
                                 sizeof(float)) == 0;
    }
    differ += !same;
  }
  return differ;
}

class Fp8PermuteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!on_sm90()) GTEST_SKIP() << "needs an sm_90 device (the kernels are built for sm_90a only)";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Device buffers of one case.
  struct Buffers {
    explicit Buffers(const Case& c)
        : slots(sizeof(int32_t) * c.entries()), counts(sizeof(int32_t) * c.slots),
          offsets(sizeof(int32_t) * (c.slots + 1)), cursor(sizeof(int32_t) * c.slots),
          entry_row(sizeof(int32_t) * c.entries()), permuted(sizeof(uint16_t) * c.entries() * c.hidden),
          q(static_cast<size_t>((c.entries() + kSpareRows) * c.hidden)),
          scales(sizeof(float) * (c.entries() + kSpareRows) * c.k_blocks()) {}
    DeviceBuffer x, slots, counts, offsets, cursor, entry_row, permuted, q, scales;
  };

  void poison(Buffers& b) {
    ASSERT_EQ(cudaMemsetAsync(b.q.as<void>(), kQPoison, b.q.bytes(), stream_), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(b.scales.as<void>(), 0xff, b.scales.bytes(), stream_), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(b.entry_row.as<void>(), 0xff, b.entry_row.bytes(), stream_), cudaSuccess);
  }
  // The layer's sequence up to the scatter: slot counts and offsets, the cursor a copy of the offsets.
  void count_slots(const Case& c, Buffers& b) {
    ASSERT_EQ(cuda::moe::launch_slot_counts(b.slots.as<int32_t>(), c.entries(), c.slots, b.counts.as<int32_t>(),
                                            b.offsets.as<int32_t>(), stream_),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(b.cursor.as<int32_t>(), b.offsets.as<int32_t>(), sizeof(int32_t) * c.slots,
                              cudaMemcpyDeviceToDevice, stream_),
              cudaSuccess);
  }
  void launch_fused(const Case& c, Buffers& b) {
    ASSERT_EQ(cuda::moe::launch_permute_rows_fp8(b.x.as<uint16_t>(), c.tokens, c.top_k, c.hidden, b.slots.as<int32_t>(),
                                                 b.offsets.as<int32_t>(), b.cursor.as<int32_t>(),
                                                 b.entry_row.as<int32_t>(), b.q.as<uint8_t>(), b.scales.as<float>(),
                                                 stream_),
              cudaSuccess);
  }
  Fp8Rows read_back(const Case& c, const Buffers& b) {
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const int64_t rows = c.entries() + kSpareRows;
    return {to_host(b.offsets.as<int32_t>(), c.slots + 1), to_host(b.entry_row.as<int32_t>(), c.entries()),
            to_host(b.q.as<uint8_t>(), rows * c.hidden), to_host(b.scales.as<float>(), rows * c.k_blocks())};
  }
  Fp8Rows run_fused(const Case& c, Buffers& b) {
    poison(b);
    count_slots(c, b);
    launch_fused(c, b);
    return read_back(c, b);
  }
  // The path before the fusion: bf16 permuted rows, then their quantization with the slots as groups.
  Fp8Rows run_unfused(const Case& c, Buffers& b) {
    poison(b);
    count_slots(c, b);
    EXPECT_EQ(cuda::moe::launch_permute_rows(b.x.as<uint16_t>(), c.tokens, c.top_k, c.hidden, b.slots.as<int32_t>(),
                                             b.cursor.as<int32_t>(), b.entry_row.as<int32_t>(),
                                             b.permuted.as<uint16_t>(), stream_),
              cudaSuccess);
    EXPECT_EQ(gpu::launch_quantize_rows_fp8(b.permuted.as<uint16_t>(), c.hidden, b.offsets.as<int32_t>(), c.slots,
                                            c.entries(), b.q.as<uint8_t>(), b.scales.as<float>(), stream_),
              cudaSuccess);
    return read_back(c, b);
  }

  cudaStream_t stream_ = nullptr;
};

// Checks one run against the composed CPU reference.
void expect_matches_reference(const Case& c, const Routing& r, const Fp8Rows& got, const char* which) {
  SCOPED_TRACE(which);
  const moe::SlotLayout layout = moe::slot_layout_reference(r.slots, c.slots);
  ASSERT_EQ(got.offsets, layout.offsets);
  ASSERT_TRUE(is_slot_permutation(got.entry_row, r.slots, got.offsets));
  const Fp8Rows ref = reference_rows(c, r, layout.offsets, got.entry_row);
  EXPECT_EQ(got.q, ref.q) << "q (poison 0xAA past the T * k rows included)";
  EXPECT_TRUE(same_bits(got.scales, ref.scales)) << "scales (NaN poison past the T * k rows included)";
}

TEST_F(Fp8PermuteTest, FusedEqualsPermuteThenQuantizeBitwise) {
  for (const Case c : {Case{333, 2048, 8, 144}, Case{1024, 2048, 8, 128}, Case{19, 384, 4, 20}, Case{64, 768, 16, 40},
                       Case{1, 128, 1, 3}}) {
    SCOPED_TRACE(c.name());
    const Routing r = make_routing(c, 100 + c.tokens);
    Buffers b(c);
    b.x = to_device(r.x);
    b.slots = to_device(r.slots);
    const Fp8Rows fused = run_fused(c, b);
    const Fp8Rows unfused = run_unfused(c, b);
    expect_matches_reference(c, r, fused, "fused");
    expect_matches_reference(c, r, unfused, "permute + launch_quantize_rows_fp8");
    EXPECT_EQ(entries_differing(c, r.slots, fused, unfused), 0) << "entries whose codes or scales differ";
    // The special rows came out as intended (the test's premise), on the reference's quantization of token 0/2.
    if (c.tokens >= 3) {
      const int64_t e0 = 0, e2 = 2 * c.top_k;  // entry 0 of tokens 0 and 2
      const int64_t s0 = r.slots[e0], f0 = fused.offsets[s0], m0 = fused.offsets[s0 + 1] - f0;
      for (int kb = 0; kb < c.k_blocks(); ++kb) {
        EXPECT_EQ(fused.scales[f0 * c.k_blocks() + kb * m0 + (fused.entry_row[e0] - f0)], 0.0f);
      }
      for (int q = 0; q < kBlock; ++q) EXPECT_EQ(fused.q[int64_t{fused.entry_row[e2]} * c.hidden + q] & 0x7f, 0x7e);
    }
  }
}

// One capture of the layer's sequence (slot counts, cursor copy, fused permutation) replayed with other slots on
// the device: every replay equal to the reference of its slots.
TEST_F(Fp8PermuteTest, CapturedPermutationReplaysWithNewSlots) {
  const Case c{200, 768, 8, 24};
  const Routing r = make_routing(c, 7);
  Buffers b(c);
  b.x = to_device(r.x);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  count_slots(c, b);
  launch_fused(c, b);
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  std::vector<std::vector<int32_t>> slot_sets = {make_routing(c, 8).slots, make_routing(c, 9).slots,
                                                 std::vector<int32_t>(static_cast<size_t>(c.entries()), c.slots - 1)};
  for (size_t set = 0; set < slot_sets.size(); ++set) {
    SCOPED_TRACE(fmt::format("slot set {}", set));
    const Routing replay{r.x, slot_sets[set]};
    ASSERT_EQ(cudaMemcpyAsync(b.slots.as<int32_t>(), replay.slots.data(), sizeof(int32_t) * replay.slots.size(),
                              cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    poison(b);
    ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    expect_matches_reference(c, replay, read_back(c, b), "replay");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST(Fp8PermuteRules, LauncherRefusesBadArguments) {
  // Host pointers stand in for device ones: every call below must fail before launching.
  alignas(16) static uint16_t x[256];
  alignas(16) static uint8_t q[256];
  static float scales[4];
  static int32_t slots[2], offsets[3], cursor[2], entry_row[2];
  const auto launch = [&](const uint16_t* xp, int64_t tokens, int top_k, int hidden, uint8_t* qp, float* sp,
                          bool null_slots = false) {
    return cuda::moe::launch_permute_rows_fp8(xp, tokens, top_k, hidden, null_slots ? nullptr : slots, offsets, cursor,
                                              entry_row, qp, sp, nullptr);
  };
  EXPECT_EQ(launch(x, 1, 1, 100, q, scales), cudaErrorInvalidValue);  // H % 128
  EXPECT_EQ(launch(x, 1, 1, 0, q, scales), cudaErrorInvalidValue);
  EXPECT_EQ(launch(x, 1, 0, 128, q, scales), cudaErrorInvalidValue);  // top_k outside [1, 16]
  EXPECT_EQ(launch(x, 1, cuda::moe::kMaxTopK + 1, 128, q, scales), cudaErrorInvalidValue);
  EXPECT_EQ(launch(x, -1, 1, 128, q, scales), cudaErrorInvalidValue);
  EXPECT_EQ(launch(x + 1, 1, 1, 128, q, scales), cudaErrorInvalidValue);  // x not 16-byte aligned
  EXPECT_EQ(launch(x, 1, 1, 128, q + 8, scales), cudaErrorInvalidValue);  // q not 16-byte aligned
  EXPECT_EQ(launch(nullptr, 1, 1, 128, q, scales), cudaErrorInvalidValue);
  EXPECT_EQ(launch(x, 1, 1, 128, q, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(launch(x, 1, 1, 128, q, scales, true), cudaErrorInvalidValue);  // null slots
  EXPECT_EQ(launch(x, 0, 1, 128, q, scales), cudaSuccess);  // no tokens: nothing to launch
}

// ---- The layer ----

struct LayerCase {
  int hidden, intermediate, experts, top_k;
  int64_t tokens;
};
constexpr int kExtraSlots = 4;
constexpr uint64_t kSeed = 91;

// An FP8 layer (generated FP8 experts in a slot pool) with P = E + 4 shuffled slots, static replica choice.
struct Fp8Layer {
  explicit Fp8Layer(const LayerCase& c)
      : map(layer_map_for(c.experts, kExtraSlots, 12)),
        pool({.num_layers = 1, .slots_per_layer = static_cast<int>(map.size()), .hidden_size = c.hidden,
              .moe_intermediate_size = c.intermediate, .spare = 0, .fp8 = true}, 0),
        router(to_device(to_bits(random_bf16_values(int64_t{c.experts} * c.hidden, 3, 0.05f)))) {
    backend::MoeLayerShape shape =
        moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, static_cast<int>(map.size()), c.tokens);
    shape.fp8_experts = true;
    shape.external_weights = true;
    layer = std::make_unique<GpuMoeLayer>(shape, 0);
    pool.fill_layer(0, map, kSeed);
    layer->set_router_weights(router.as<uint16_t>());
    layer->set_fp8_slot_weights(pool.fp8_ptrs(0));
    const eplb::Topology topo{static_cast<int>(map.size()), 1, 1};
    layer->set_replica_choice(moe::make_replica_choice(eplb::DispatchAlgorithm::kStatic, map, c.experts, topo, c.tokens, {}));
  }
  int num_slots() const { return static_cast<int>(map.size()); }
  std::vector<int32_t> map;
  backend::GpuSlotPool pool;
  DeviceBuffer router;
  std::unique_ptr<GpuMoeLayer> layer;
};

// Poisons the layer's bf16 permuted rows [n, H] (0xffff), synchronized.
void poison_permuted(const GpuMoeLayer& layer, int64_t n, int hidden) {
  ASSERT_EQ(cudaMemset(const_cast<uint16_t*>(layer.permuted()), 0xff, sizeof(uint16_t) * n * hidden), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

bool permuted_untouched(const GpuMoeLayer& layer, int64_t n, int hidden) {
  const std::vector<uint16_t> rows = to_host(layer.permuted(), n * hidden);
  return std::all_of(rows.begin(), rows.end(), [](uint16_t v) { return v == 0xffffu; });
}

TEST(Fp8FusedPermuteLayer, OutputBitwiseEqualWithAndWithoutTheFusion) {
  if (!on_sm90()) GTEST_SKIP() << "needs an sm_90 device (CUTLASS FP8 grouped GEMM)";
  for (const LayerCase c : {LayerCase{256, 256, 16, 4, 333}, LayerCase{2048, 768, 16, 8, 257}}) {
    SCOPED_TRACE(fmt::format("H {} I {} k {} T {}", c.hidden, c.intermediate, c.top_k, c.tokens));
    Fp8Layer f(c);
    ASSERT_FALSE(f.layer->uses_skinny(c.tokens));
    ASSERT_TRUE(f.layer->uses_cutlass()) << f.layer->cutlass_fallback_reason();
    const DeviceBuffer d_x = to_device(to_bits(random_bf16_values(c.tokens * c.hidden, 4, 1.0f)));
    const DeviceBuffer d_logits = to_device(random_logits(c.tokens, c.experts, 5));
    const int64_t n = c.tokens * c.top_k;
    DeviceBuffer d_out(sizeof(float) * c.tokens * c.hidden);
    const auto forward_with = [&](bool fused) {
      f.layer->set_fp8_fused_permute(fused);
      EXPECT_EQ(f.layer->fp8_fused_permute(), fused);
      poison_permuted(*f.layer, n, c.hidden);
      EXPECT_EQ(cudaMemset(d_out.as<void>(), 0xff, d_out.bytes()), cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      f.layer->forward_from_logits(d_x.as<uint16_t>(), d_logits.as<float>(), c.tokens, d_out.as<float>());
      f.layer->synchronize();
      return std::pair(to_host(d_out.as<float>(), c.tokens * c.hidden), permuted_untouched(*f.layer, n, c.hidden));
    };
    const auto [fused_out, fused_untouched] = forward_with(true);
    const auto [plain_out, plain_untouched] = forward_with(false);
    EXPECT_TRUE(fused_untouched) << "the fused forward wrote bf16 permuted rows: it did not take the fused path";
    EXPECT_FALSE(plain_untouched) << "the unfused forward wrote no bf16 permuted rows";
    EXPECT_TRUE(bitwise_equal(fused_out, plain_out)) << "fused vs unfused";
    EXPECT_TRUE(bitwise_equal(forward_with(true).first, plain_out)) << "fused again, after an unfused forward";
  }
}

// After a fused permute, run_experts over slot sub-ranges (groups = offsets + first slot; nothing left to
// quantize) gives per entry the bits of the unfused whole stage.
TEST(Fp8FusedPermuteLayer, SlotRangesAfterAFusedPermute) {
  if (!on_sm90()) GTEST_SKIP() << "needs an sm_90 device (CUTLASS FP8 grouped GEMM)";
  const LayerCase c{2048, 768, 16, 8, 101};
  Fp8Layer f(c);
  const int p = f.num_slots();
  const int64_t n = c.tokens * c.top_k, h = c.hidden;
  const DeviceBuffer d_x = to_device(to_bits(random_bf16_values(c.tokens * c.hidden, 48, 1.0f)));
  const DeviceBuffer d_logits = to_device(random_logits(c.tokens, c.experts, 49));
  f.layer->set_fp8_fused_permute(false);
  f.layer->route(d_logits.as<float>(), c.tokens);
  f.layer->permute(d_x.as<uint16_t>(), c.tokens);
  f.layer->run_experts(0, p);
  f.layer->synchronize();
  const std::vector<uint16_t> whole = to_host(f.layer->expert_out(), n * h);
  const std::vector<int32_t> whole_rows = to_host(f.layer->entry_row(), n);

  f.layer->set_fp8_fused_permute(true);
  f.layer->route(d_logits.as<float>(), c.tokens);
  f.layer->permute(d_x.as<uint16_t>(), c.tokens);
  f.layer->synchronize();
  ASSERT_EQ(cudaMemset(const_cast<uint16_t*>(f.layer->expert_out()), 0xff, sizeof(uint16_t) * n * h), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (const auto& [b, e] : {std::pair{0, 7}, std::pair{7, 7}, std::pair{7, 13}, std::pair{13, p}}) f.layer->run_experts(b, e);
  f.layer->synchronize();
  const std::vector<uint16_t> parts = to_host(f.layer->expert_out(), n * h);
  const std::vector<int32_t> parts_rows = to_host(f.layer->entry_row(), n);
  int64_t differ = 0;
  for (int64_t e = 0; e < n; ++e) {
    differ += !std::equal(parts.begin() + int64_t{parts_rows[e]} * h, parts.begin() + int64_t{parts_rows[e] + 1} * h,
                          whole.begin() + int64_t{whole_rows[e]} * h);
  }
  EXPECT_EQ(differ, 0) << "entries whose expert output rows differ";
}

}  // namespace
}  // namespace fulcrum::test
