// The expert skinny GEMMs with FP8 weights (gpu::launch_expert_skinny_gemm with fp8_weights / fp8_scales: e4m3
// [w_rows, k] and fp32 scales [k / 128][w_rows / 128] per slot) against the CPU reference
// (reference::skinny_gemm_fp8 per slot, plus the bf16 roundings and SwiGLU of the kernel's contract), on fresh
// random inputs: x bf16 in [-1, 1), every non-NaN e4m3 byte equally likely (zeros, subnormals, up to +-448),
// scales in [0.5, 1.5) / 1024. Shapes: Qwen3-30B-A3B's experts (gate_up + SwiGLU: I 768, w_rows 1536, k 2048;
// down: n 2048, k 768) and small ones (n 128, k 256, SwiGLU and plain); 1, 2, 4 and 8 tokens x top-8 over 128
// slots (every token also on one hot slot, so slots hold 1 .. T rows; a quarter of the slots never get rows and
// point at NaN weights: reading them would show). SwiGLU rows read their token's x row (row_source), plain rows
// their own x row (row_source null, as the down GEMM). Outputs are poisoned (0xffff, a bf16 NaN) with a guard
// past rows x n that must stay poisoned.
//
// Asserted: every value within the tolerance below; a token run alone (the same max_rows, so the same K split)
// gives its rows' bits of the batch run; the kernel variants (max_slot_rows = T: 1-row chunks with 8 W rows per
// warp at T = 1; 0: chunks of 8 with 4) give the same bits; bad arguments are refused; a captured launch replays
// to the same bits.
//
// Tolerances and why:
//   fp32 sums  |s_gpu - s_ref| <= b = 4e-6 * sum_k |x_k W_k| (W = e4m3 value x scale). The reference is the
//              correctly rounded sum (double). In the kernel each product of an e4m3 and a bf16 value is exact
//              in fp32 (4 + 8 significant bits); a lane sums a chunk's 16 products in an fp32 FMA chain (at most
//              15 roundings), folds it into its accumulator with one FMA by the block scale (the scaling itself
//              exact inside the FMA; 1 rounding, then 1 per later chunk of the lane: at most k / 512 in all),
//              then 5 butterfly and at most 3 slice additions: at most 15 + k / 512 + 8 = 27 roundings on any
//              product's path at k = 2048, so |error| <= 27 * 2^-24 * sum |x W| = 1.6e-6 * sum |x W| (first
//              order), under b.
//   plain      out = bf16(s_gpu): |out - s_ref| <= b + one bf16 step at |s_ref| (a rounding across a boundary).
//   SwiGLU     out = bf16(silu(g) * u), g = bf16(gate sum), u = bf16(up sum): the kernel's g is bf16(s) for some
//              s within b of the reference gate sum, so g lies between the bf16 roundings of ref - b and ref + b
//              (usually one value, two near a rounding boundary); likewise u. The output must lie within one bf16
//              step of the range of silu(g') * u' (in double) over those g', u': the kernel's fp32 expf, division
//              and product are within a few fp32 ulps, far below half a bf16 step.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/kernels/expert_skinny_gemm.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "gpu/reference/skinny_gemm_reference.hpp"
#include "skinny_test_util.hpp"
#include "model/checkpoint_writer.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using namespace skinny_test;

constexpr double kRelTolerance = 4e-6;  // of sum |x W|; see the file comment
constexpr int kBlock = 128;
constexpr int kTopK = 8;
constexpr int kNumSlots = 128;
constexpr int kHotSlot = 5;       // every token's first entry
constexpr int kGuard = 64;        // poisoned bf16 values after the rows x n output
constexpr uint16_t kPoison = 0xffff;

class ExpertSkinnyFp8Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the FP8 skinny GEMM tests need a GPU";
  }
};

float bf16(uint16_t bits) { return model::bf16_bits_to_f32(bits); }

// [lo, hi]: the least and the greatest bf16 value that a fp32 value within `bound` of `ref` rounds to (round to
// nearest even is monotonic: the roundings of the interval's ends, widened by one fp32 step against the
// double -> float conversion).
struct Range {
  double lo, hi;
};
Range bf16_roundings(double ref, double bound) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  return {bf16(model::f32_to_bf16_bits(std::nextafter(static_cast<float>(ref - bound), -kInf))),
          bf16(model::f32_to_bf16_bits(std::nextafter(static_cast<float>(ref + bound), kInf)))};
}

// The range of silu(g) * u over g in [g.lo, g.hi], u in [u.lo, u.hi] (silu falls down to its minimum at
// g = -1.2785, then rises; the product is linear in u).
Range swiglu_range(Range g, Range u) {
  constexpr double kSiluArgMin = -1.27846454276107;
  const auto silu = [](double v) { return v / (1.0 + std::exp(-v)); };
  double s_lo = std::min(silu(g.lo), silu(g.hi)), s_hi = std::max(silu(g.lo), silu(g.hi));
  if (g.lo < kSiluArgMin && kSiluArgMin < g.hi) s_lo = silu(kSiluArgMin);
  const double corners[] = {s_lo * u.lo, s_lo * u.hi, s_hi * u.lo, s_hi * u.hi};
  return {*std::min_element(std::begin(corners), std::end(corners)),
          *std::max_element(std::begin(corners), std::end(corners))};
}

struct Shape {
  int n;  // output columns (SwiGLU: I)
  int k;
  bool swiglu;
  const char* name;
  int w_rows() const { return swiglu ? 2 * n : n; }
};
const Shape kShapes[] = {
    {768, 2048, true, "gate_up 1536 x 2048 + SwiGLU"},
    {2048, 768, false, "down 2048 x 768"},
    {128, 256, true, "small 256 x 256 + SwiGLU"},
    {128, 256, false, "small 128 x 256"},
};

// A slot never routed to: its weights are NaN bytes (any read of them would poison the output).
bool never_used(int slot) { return slot % 4 == 3; }

// Per-slot FP8 weights on the host (routed slots only) and the device, with the device pointer arrays.
struct SlotWeights {
  std::vector<std::vector<uint8_t>> q;       // [P][w_rows * k] (empty for unused slots)
  std::vector<std::vector<float>> scales;    // [P][k / 128 * w_rows / 128]
  std::vector<DeviceBuffer> d_q, d_scales;
  DeviceBuffer d_nan_q, d_nan_scales;
  DeviceBuffer d_q_ptrs, d_scale_ptrs;       // [P] device pointers

  SlotWeights(const Shape& shape, uint64_t seed) : q(kNumSlots), scales(kNumSlots) {
    const size_t q_count = static_cast<size_t>(shape.w_rows()) * shape.k;
    const size_t scale_count = static_cast<size_t>(shape.k / kBlock) * (shape.w_rows() / kBlock);
    d_nan_q = upload(std::vector<uint8_t>(q_count, 0x7f));
    d_nan_scales = upload(std::vector<float>(scale_count, std::numeric_limits<float>::quiet_NaN()));
    std::vector<const uint8_t*> q_ptrs(kNumSlots);
    std::vector<const float*> scale_ptrs(kNumSlots);
    for (int s = 0; s < kNumSlots; ++s) {
      if (never_used(s)) {
        q_ptrs[s] = d_nan_q.as<uint8_t>();
        scale_ptrs[s] = d_nan_scales.as<float>();
        continue;
      }
      q[s] = random_e4m3(q_count, seed + 2 * s);
      scales[s] = random_scales(scale_count, seed + 2 * s + 1);
      d_q.push_back(upload(q[s]));
      d_scales.push_back(upload(scales[s]));
      q_ptrs[s] = d_q.back().as<uint8_t>();
      scale_ptrs[s] = d_scales.back().as<float>();
    }
    d_q_ptrs = upload(q_ptrs);
    d_scale_ptrs = upload(scale_ptrs);
  }
};

// A routing of `tokens` tokens: entry e = token * 8 + j goes to slot_of[e] (distinct per token; j = 0 the hot
// slot), permuted slot-major (rows of a slot in entry order) as the MoE layer's small permutation does.
struct Routing {
  int tokens = 0;
  std::vector<int32_t> slot_of;    // [entries]
  std::vector<int32_t> row_of;     // [entries] permuted row
  std::vector<int32_t> entry_of;   // [rows] entry of each permuted row
  std::vector<int32_t> offsets;    // [P + 1]
  std::vector<int32_t> active;     // [1 + count]: count, then the slots with rows in shuffled order
  int max_slot_rows = 0;           // largest slot's rows
};

Routing permute(int tokens, std::vector<int32_t> slot_of, uint32_t seed) {
  Routing r;
  r.tokens = tokens;
  r.slot_of = std::move(slot_of);
  const int entries = static_cast<int>(r.slot_of.size());
  std::vector<int32_t> counts(kNumSlots, 0);
  for (const int32_t s : r.slot_of) ++counts[s];
  r.offsets.assign(kNumSlots + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), r.offsets.begin() + 1);
  std::vector<int32_t> cursor(r.offsets.begin(), r.offsets.end() - 1);
  r.row_of.resize(entries);
  r.entry_of.resize(entries);
  for (int e = 0; e < entries; ++e) {
    r.row_of[e] = cursor[r.slot_of[e]]++;
    r.entry_of[r.row_of[e]] = e;
  }
  std::vector<int32_t> slots;
  for (int s = 0; s < kNumSlots; ++s) {
    if (counts[s] > 0) slots.push_back(s);
    r.max_slot_rows = std::max(r.max_slot_rows, counts[s]);
  }
  std::mt19937 rng(seed);
  std::shuffle(slots.begin(), slots.end(), rng);
  r.active = {static_cast<int32_t>(slots.size())};
  r.active.insert(r.active.end(), slots.begin(), slots.end());
  return r;
}

Routing random_routing(int tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> slot_of;
  for (int t = 0; t < tokens; ++t) {
    std::vector<int32_t> chosen{kHotSlot};
    while (static_cast<int>(chosen.size()) < kTopK) {
      const int32_t s = static_cast<int32_t>(rng() % kNumSlots);
      if (!never_used(s) && std::find(chosen.begin(), chosen.end(), s) == chosen.end()) chosen.push_back(s);
    }
    slot_of.insert(slot_of.end(), chosen.begin(), chosen.end());
  }
  return permute(tokens, std::move(slot_of), seed + 1);
}

// x of an entry: SwiGLU, its token's row of x_tokens [T, k]; plain, its own row of x_entries [entries, k].
const uint16_t* entry_x(const Shape& shape, const std::vector<uint16_t>& x, int entry) {
  const int row = shape.swiglu ? entry / kTopK : entry;
  return x.data() + static_cast<size_t>(row) * shape.k;
}

// Runs the kernel for `routing` into a poisoned output of rows x n + kGuard values; returns them. max_rows is
// the launch's bound (the batch's, also for a token run alone).
std::vector<uint16_t> run(const Shape& shape, const SlotWeights& w, const std::vector<uint16_t>& x,
                          const Routing& routing, int max_rows, int max_slot_rows, cudaStream_t stream = nullptr) {
  const int rows = static_cast<int>(routing.entry_of.size());
  // SwiGLU: x stays [T, k], rows read it through row_source. Plain: x in permuted row order, no row_source.
  std::vector<uint16_t> x_dev_rows;
  std::vector<int32_t> source(rows);
  for (int r = 0; r < rows; ++r) {
    const int e = routing.entry_of[r];
    source[r] = e / kTopK;
    const uint16_t* xr = entry_x(shape, x, e);
    if (!shape.swiglu) x_dev_rows.insert(x_dev_rows.end(), xr, xr + shape.k);
  }
  const DeviceBuffer d_x = upload(shape.swiglu ? x : x_dev_rows), d_source = upload(source),
                     d_offsets = upload(routing.offsets), d_active = upload(routing.active);
  const size_t count = static_cast<size_t>(rows) * shape.n + kGuard;
  DeviceBuffer d_out(sizeof(uint16_t) * count);
  EXPECT_EQ(cudaMemset(d_out.as<uint16_t>(), 0xff, sizeof(uint16_t) * count), cudaSuccess);
  gpu::ExpertSkinnyArgs a;
  a.x = d_x.as<uint16_t>();
  a.row_source = shape.swiglu ? d_source.as<int32_t>() : nullptr;
  a.offsets = d_offsets.as<int32_t>();
  a.active = d_active.as<int32_t>();
  a.fp8_weights = w.d_q_ptrs.as<const uint8_t* const>();
  a.fp8_scales = w.d_scale_ptrs.as<const float* const>();
  a.n = shape.n;
  a.k = shape.k;
  a.max_rows = max_rows;
  a.num_slots = kNumSlots;
  a.max_slot_rows = max_slot_rows;
  a.swiglu = shape.swiglu;
  a.out = d_out.as<uint16_t>();
  EXPECT_EQ(gpu::launch_expert_skinny_gemm(a, stream), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  return download(d_out.as<uint16_t>(), count);
}

// Reference sums of every permuted row: [rows, w_rows] (and sum |x W|), one reference call per slot.
struct RowSums {
  std::vector<float> sums, abs_sums;
};
RowSums reference_sums(const Shape& shape, const SlotWeights& w, const std::vector<uint16_t>& x, const Routing& routing) {
  const int rows = static_cast<int>(routing.entry_of.size()), w_rows = shape.w_rows();
  RowSums out{std::vector<float>(static_cast<size_t>(rows) * w_rows), std::vector<float>(static_cast<size_t>(rows) * w_rows)};
  for (int s = 0; s < kNumSlots; ++s) {
    const int first = routing.offsets[s], m = routing.offsets[s + 1] - first;
    if (m == 0) continue;
    std::vector<uint16_t> xs;  // [m, k]
    for (int r = first; r < first + m; ++r) {
      const uint16_t* xr = entry_x(shape, x, routing.entry_of[r]);
      xs.insert(xs.end(), xr, xr + shape.k);
    }
    const size_t at = static_cast<size_t>(first) * w_rows, len = static_cast<size_t>(m) * w_rows;
    gpu::reference::skinny_gemm_fp8(xs, w.q[s], w.scales[s], m, w_rows, shape.k,
                                    std::span<float>(out.sums.data() + at, len),
                                    std::span<float>(out.abs_sums.data() + at, len));
  }
  return out;
}

// Whether bf16 output `got` of (row, column) agrees with the reference sums (file comment).
bool close_to_reference(const Shape& shape, const RowSums& ref, int row, int col, uint16_t got) {
  const size_t base = static_cast<size_t>(row) * shape.w_rows();
  const double value = bf16(got);
  if (!shape.swiglu) {
    const double r = ref.sums[base + col], bound = kRelTolerance * ref.abs_sums[base + col];
    return std::abs(value - r) <= bound + bf16_spacing_above(static_cast<float>(std::abs(r)));  // NaN fails
  }
  const size_t gate = base + col, up = base + shape.n + col;
  const Range h = swiglu_range(bf16_roundings(ref.sums[gate], kRelTolerance * ref.abs_sums[gate]),
                               bf16_roundings(ref.sums[up], kRelTolerance * ref.abs_sums[up]));
  const double step = bf16_spacing_above(static_cast<float>(std::max(std::abs(h.lo), std::abs(h.hi))));
  return h.lo - step <= value && value <= h.hi + step;  // NaN fails
}

// How many values differ bitwise (-1: the sizes differ).
int64_t differences(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  if (a.size() != b.size()) return -1;
  int64_t count = 0;
  for (size_t q = 0; q < a.size(); ++q) count += a[q] != b[q];
  return count;
}

// The rows of `entries` (in that order) of an output with routing `routing`.
std::vector<uint16_t> rows_of_entries(const std::vector<uint16_t>& out, const Routing& routing,
                                      const std::vector<int>& entries, int n) {
  std::vector<uint16_t> rows;
  for (const int e : entries) {
    const auto first = out.begin() + static_cast<int64_t>(routing.row_of[e]) * n;
    rows.insert(rows.end(), first, first + n);
  }
  return rows;
}

TEST_F(ExpertSkinnyFp8Test, MatchesReferenceAndIsPerRow) {
  uint64_t seed = 100;
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(::testing::Message() << shape.name);
    const SlotWeights weights(shape, seed);
    seed += 1000;
    for (const int tokens : {1, 2, 4, 8}) {
      SCOPED_TRACE(::testing::Message() << tokens << " tokens");
      const Routing routing = random_routing(tokens, static_cast<uint32_t>(seed++));
      const int entries = tokens * kTopK, max_rows = entries;
      const std::vector<uint16_t> x =
          random_bf16(static_cast<size_t>(shape.swiglu ? tokens : entries) * shape.k, seed++);
      ASSERT_EQ(routing.max_slot_rows, tokens);  // the hot slot holds every token
      const std::vector<uint16_t> out = run(shape, weights, x, routing, max_rows, tokens);
      const RowSums ref = reference_sums(shape, weights, x, routing);

      int64_t bad = 0, first_bad = -1, guard_written = 0;
      for (int r = 0; r < entries; ++r) {
        for (int c = 0; c < shape.n; ++c) {
          const uint16_t got = out[static_cast<size_t>(r) * shape.n + c];
          if (!close_to_reference(shape, ref, r, c, got) && bad++ == 0) first_bad = int64_t{r} * shape.n + c;
        }
      }
      for (size_t q = static_cast<size_t>(entries) * shape.n; q < out.size(); ++q) guard_written += out[q] != kPoison;
      EXPECT_EQ(bad, 0) << "values off the reference; first at row " << first_bad / shape.n << " column "
                        << first_bad % shape.n << ": " << (bad ? bf16(out[first_bad]) : 0.0f);
      EXPECT_EQ(guard_written, 0) << "guard overwritten";

      // The other kernel variant (chunks of max_rows rows) gives the same bits.
      EXPECT_EQ(differences(run(shape, weights, x, routing, max_rows, 0), out), 0) << "max_slot_rows 0 vs " << tokens;

      // Each token alone (its 8 rows, one per slot; the batch's max_rows): its rows' bits of the batch run.
      for (int t = 0; tokens > 1 && t < tokens; ++t) {
        std::vector<int> its_entries(kTopK);
        std::iota(its_entries.begin(), its_entries.end(), t * kTopK);
        const Routing alone =
            permute(1, std::vector<int32_t>(routing.slot_of.begin() + t * kTopK, routing.slot_of.begin() + (t + 1) * kTopK),
                    static_cast<uint32_t>(seed + t));
        // The token's x as the alone run's token 0 (SwiGLU) or entries 0..7 (plain).
        std::vector<uint16_t> x_alone;
        for (const int e : its_entries) {
          const uint16_t* xr = entry_x(shape, x, e);
          if (!shape.swiglu || e == t * kTopK) x_alone.insert(x_alone.end(), xr, xr + shape.k);
        }
        const std::vector<uint16_t> alone_out = run(shape, weights, x_alone, alone, max_rows, 1);
        std::vector<int> alone_entries(kTopK);
        std::iota(alone_entries.begin(), alone_entries.end(), 0);
        EXPECT_EQ(differences(rows_of_entries(alone_out, alone, alone_entries, shape.n),
                              rows_of_entries(out, routing, its_entries, shape.n)),
                  0)
            << "token " << t << " alone differs from its rows in the batch";
      }
    }
  }
}

TEST_F(ExpertSkinnyFp8Test, RefusesBadArguments) {
  const Shape shape{128, 256, false, "small"};
  const SlotWeights weights(shape, 7);
  const Routing routing = random_routing(1, 8);
  const std::vector<uint16_t> x = random_bf16(static_cast<size_t>(kTopK) * 512, 9);
  const DeviceBuffer d_x = upload(x), d_offsets = upload(routing.offsets), d_active = upload(routing.active);
  const DeviceBuffer d_bf16_ptrs = upload(std::vector<const uint16_t*>(kNumSlots, d_x.as<uint16_t>()));
  DeviceBuffer d_out(sizeof(uint16_t) * kTopK * 512);
  gpu::ExpertSkinnyArgs good;
  good.x = d_x.as<uint16_t>();
  good.offsets = d_offsets.as<int32_t>();
  good.active = d_active.as<int32_t>();
  good.fp8_weights = weights.d_q_ptrs.as<const uint8_t* const>();
  good.fp8_scales = weights.d_scale_ptrs.as<const float* const>();
  good.n = shape.n;
  good.k = shape.k;
  good.max_rows = kTopK;
  good.num_slots = kNumSlots;
  good.out = d_out.as<uint16_t>();
  EXPECT_EQ(gpu::launch_expert_skinny_gemm(good, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const auto refused = [&](auto change, const char* what) {
    gpu::ExpertSkinnyArgs a = good;
    change(a);
    EXPECT_EQ(gpu::launch_expert_skinny_gemm(a, nullptr), cudaErrorInvalidValue) << what;
  };
  refused([](gpu::ExpertSkinnyArgs& a) { a.k = 136; }, "k % 128 != 0 (k % 8 == 0)");
  refused([](gpu::ExpertSkinnyArgs& a) { a.k = 64; }, "k < 128");
  refused([](gpu::ExpertSkinnyArgs& a) { a.n = 192; }, "n % 128 != 0");
  refused(
      [](gpu::ExpertSkinnyArgs& a) {
        a.n = 64;
        a.swiglu = true;
      },
      "SwiGLU I % 128 != 0");
  refused([](gpu::ExpertSkinnyArgs& a) { a.fp8_scales = nullptr; }, "FP8 weights without scales");
  refused([&](gpu::ExpertSkinnyArgs& a) { a.weights = d_bf16_ptrs.as<const uint16_t* const>(); },
          "bf16 and FP8 weights");
  refused(
      [&](gpu::ExpertSkinnyArgs& a) {
        a.weights = d_bf16_ptrs.as<const uint16_t* const>();
        a.fp8_weights = nullptr;
      },
      "bf16 weights with FP8 scales");
  refused(
      [](gpu::ExpertSkinnyArgs& a) {
        a.fp8_weights = nullptr;
        a.fp8_scales = nullptr;
      },
      "no weights");
  refused([](gpu::ExpertSkinnyArgs& a) { a.x = a.x + 1; }, "x misaligned");
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_F(ExpertSkinnyFp8Test, CapturedGraphReplaysSameBits) {
  const Shape& shape = kShapes[0];  // gate_up + SwiGLU
  const SlotWeights weights(shape, 31);
  const Routing routing = random_routing(4, 32);
  const std::vector<uint16_t> x = random_bf16(static_cast<size_t>(4) * shape.k, 33);
  const std::vector<uint16_t> direct = run(shape, weights, x, routing, 32, 4);

  const int rows = 32;
  std::vector<int32_t> source(rows);
  for (int r = 0; r < rows; ++r) source[r] = routing.entry_of[r] / kTopK;
  const DeviceBuffer d_x = upload(x), d_source = upload(source), d_offsets = upload(routing.offsets),
                     d_active = upload(routing.active);
  DeviceBuffer d_out(sizeof(uint16_t) * direct.size());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the uploads land before the non-blocking stream reads them
  gpu::ExpertSkinnyArgs a;
  a.x = d_x.as<uint16_t>();
  a.row_source = d_source.as<int32_t>();
  a.offsets = d_offsets.as<int32_t>();
  a.active = d_active.as<int32_t>();
  a.fp8_weights = weights.d_q_ptrs.as<const uint8_t* const>();
  a.fp8_scales = weights.d_scale_ptrs.as<const float* const>();
  a.n = shape.n;
  a.k = shape.k;
  a.max_rows = rows;
  a.num_slots = kNumSlots;
  a.max_slot_rows = 4;
  a.swiglu = true;
  a.out = d_out.as<uint16_t>();

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(gpu::launch_expert_skinny_gemm(a, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    ASSERT_EQ(cudaMemsetAsync(d_out.as<uint16_t>(), 0xff, sizeof(uint16_t) * direct.size(), stream), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(differences(download(d_out.as<uint16_t>(), direct.size()), direct), 0) << "replay " << replay;
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace fulcrum::test
