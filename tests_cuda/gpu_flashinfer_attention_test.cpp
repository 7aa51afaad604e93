// gpu::FlashInferAttention (FlashInfer 0.7.2 FA2 tensor-core decode and SM90 causal prefill over a paged KV pool)
// against gpu::reference::paged_attention on fresh random bf16 inputs: q and k uniform in [-2, 2] (scores of standard
// deviation ~1.3 after the 1/sqrt(128) scale: peaked softmaxes), v uniform in [-1, 1]; page size 16, pages scattered
// over the pool, some sequences owning spare pages; GQA groups 1, 4, 8 (32 / 4 heads, Qwen3-30B-A3B) and 16 (64 / 4,
// Qwen3-235B-A22B). Outputs are poisoned with NaN (0xFFFF) before every run, and every output row is scanned for NaN.
// Rows checked against the reference: all of a sequence's queries when it has at most 64, else 48 sampled ones
// (first and last included); a sampled query i of a sequence (n queries, kv_len L) is checked as a one-query
// sequence of length L - n + i + 1 over the same pages, which is the same attention by AttentionBatch's semantics.
//
// Tolerances and why:
//   |gpu - ref| <= 5e-3 + 2^-7 |ref| per element. FlashInfer multiplies bf16 q and k exactly and sums in fp32, like
//              the reference; what differs: it rounds the softmax weights to bf16 before the PV MMA while dividing
//              by the fp32 sum (<= 2^-9 max|v| = 2.0e-3), the FA2 split-KV path stores partial outputs in bf16 before
//              the merge (<= 2^-9 max|partial| = 2.0e-3 more), and both sides round the output to bf16 (the
//              difference grows by at most one ulp, <= 2^-7 |ref|). 3.9e-3 + 2^-7 |ref| is the worst case; the probe
//              on the H200 measured <= 2.2e-3 (decode) and <= 3.2e-3 (prefill) max abs vs an fp32 reference at
//              these input ranges.
//   ||gpu - ref|| / ||ref|| <= 1e-2 over the checked rows: the expected value is ~2-3e-3 (bf16 weight rounding plus
//              one-ulp output rounding differences on part of the elements; printed). Much tighter than the per-element
//              bound where it matters: a mask or length off by one key shifts each output by ~1/(effective keys),
//              small in absolute terms at long contexts but > 1e-2 relative.
//   bitwise    a CUDA-graph replay vs an eager run() under the same graph-mode plan (same kernels, same schedule,
//              same workspace; FlashInfer's kernels are deterministic), and a replay after re-planning the same
//              lengths. An eager run under a plain plan uses another schedule (the graph-mode plan always splits KV
//              over a padded grid), so it is compared with the reference only (whether it happens to match the
//              replay bitwise is printed).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "eplb/error.hpp"
#include "gpu/flashinfer/flashinfer_attention.hpp"
#include "gpu/reference/attention_reference.hpp"
#include "model/checkpoint_writer.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using gpu::FlashInferAttention;
using Kernel = FlashInferAttention::Kernel;

constexpr int kHeadDim = 128;
constexpr int kNumKvHeads = 4;
constexpr int kPageSize = 16;
constexpr double kAbsTolerance = 5e-3;
constexpr double kRelTolerance = 1.0 / 128;  // one bf16 ulp relative (2^-7)
constexpr double kRelL2Tolerance = 1e-2;
constexpr int kFullCheckQueries = 64;
constexpr int kSampledQueries = 48;
const float kSmScale = 1.0f / std::sqrt(float(kHeadDim));

// Fast deterministic bf16 values in [lo, hi) (SplitMix64): the pools hold tens of millions of values.
std::vector<uint16_t> random_bf16(size_t n, uint64_t seed, float lo, float hi) {
  std::vector<uint16_t> bits(n);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float unit = float(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    bits[i] = model::f32_to_bf16_bits(lo + (hi - lo) * unit);
  }
  return bits;
}

struct SeqSpec {
  int q_len = 0;
  int kv_len = 0;
  int spare_pages = 0;  // pages beyond ceil(kv_len / page_size) the sequence owns (not read)
};

// A K/V pool [num_pages * page_size, Hkv, D] on the host and the device.
struct Pool {
  int num_pages = 0;
  std::vector<uint16_t> k, v;
  DeviceBuffer d_k, d_v;
};

Pool make_pool(int num_pages, uint64_t seed) {
  Pool pool;
  pool.num_pages = num_pages;
  const size_t n = size_t(num_pages) * kPageSize * kNumKvHeads * kHeadDim;
  pool.k = random_bf16(n, seed, -2.0f, 2.0f);
  pool.v = random_bf16(n, seed + 1, -1.0f, 1.0f);
  pool.d_k = DeviceBuffer(n * 2);
  pool.d_v = DeviceBuffer(n * 2);
  EXPECT_EQ(cudaMemcpy(pool.d_k.as<void>(), pool.k.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(pool.d_v.as<void>(), pool.v.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return pool;
}

int pages_of(const SeqSpec& s) { return (s.kv_len + kPageSize - 1) / kPageSize + s.spare_pages; }

int pages_needed(const std::vector<SeqSpec>& seqs) {
  int total = 0;
  for (const SeqSpec& s : seqs) total += pages_of(s);
  return total;
}

// The host side of one batch: metadata and q [T, Hq, D]; pages are a random permutation of the pool's pages.
struct HostBatch {
  int num_heads = 0;
  std::vector<int32_t> q_indptr{0}, kv_page_indptr{0}, page_ids, kv_len;
  std::vector<uint16_t> q;
  int num_seqs() const { return int(kv_len.size()); }
  int num_tokens() const { return q_indptr.back(); }
  size_t out_elems() const { return size_t(num_tokens()) * num_heads * kHeadDim; }
};

HostBatch make_batch(const std::vector<SeqSpec>& seqs, int num_heads, int pool_pages, uint64_t seed) {
  HostBatch b;
  b.num_heads = num_heads;
  std::vector<int32_t> perm(static_cast<size_t>(pool_pages));
  for (int p = 0; p < pool_pages; ++p) perm[p] = p;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::shuffle(perm.begin(), perm.end(), rng);
  EXPECT_LE(pages_needed(seqs), pool_pages);
  size_t next_page = 0;
  for (const SeqSpec& s : seqs) {
    b.q_indptr.push_back(b.q_indptr.back() + s.q_len);
    const int pages = pages_of(s);
    b.page_ids.insert(b.page_ids.end(), perm.begin() + next_page, perm.begin() + next_page + pages);
    next_page += pages;
    b.kv_page_indptr.push_back(b.kv_page_indptr.back() + pages);
    b.kv_len.push_back(s.kv_len);
  }
  b.q = random_bf16(b.out_elems(), seed + 7, -2.0f, 2.0f);
  return b;
}

// Device buffers of a batch with fixed capacities (a captured graph keeps reading the same addresses) and the
// AttentionBatch view over them.
struct DeviceBatch {
  DeviceBuffer q, out, q_indptr, kv_page_indptr, page_ids, kv_len;
  gpu::AttentionBatch view;

  DeviceBatch(const Pool& pool, int max_tokens, int max_seqs, int num_heads)
      : q(size_t(std::max(max_tokens, 1)) * num_heads * kHeadDim * 2),
        out(size_t(std::max(max_tokens, 1)) * num_heads * kHeadDim * 2),
        q_indptr(4 * size_t(max_seqs + 1)),
        kv_page_indptr(4 * size_t(max_seqs + 1)),
        page_ids(4 * size_t(std::max(pool.num_pages, 1))),
        kv_len(4 * size_t(std::max(max_seqs, 1))) {
    view.q = q.as<uint16_t>();
    view.out = out.as<uint16_t>();
    view.k_pool = pool.d_k.as<uint16_t>();
    view.v_pool = pool.d_v.as<uint16_t>();
    view.q_indptr = q_indptr.as<int32_t>();
    view.kv_page_indptr = kv_page_indptr.as<int32_t>();
    view.page_ids = page_ids.as<int32_t>();
    view.kv_len = kv_len.as<int32_t>();
    view.num_heads = num_heads;
    view.num_kv_heads = kNumKvHeads;
    view.head_dim = kHeadDim;
    view.page_size = kPageSize;
    view.sm_scale = kSmScale;
  }

  // Writes the batch into the same buffers (ordered on `stream`, finished on return).
  void load(const HostBatch& b, cudaStream_t stream) {
    ASSERT_LE(b.out_elems() * 2, q.bytes());
    ASSERT_LE(b.page_ids.size() * 4, page_ids.bytes());
    const auto put = [&](const DeviceBuffer& dst, const void* src, size_t bytes) {
      if (bytes > 0) {
        ASSERT_EQ(cudaMemcpyAsync(dst.as<void>(), src, bytes, cudaMemcpyHostToDevice, stream), cudaSuccess);
      }
    };
    put(q, b.q.data(), b.q.size() * 2);
    put(q_indptr, b.q_indptr.data(), b.q_indptr.size() * 4);
    put(kv_page_indptr, b.kv_page_indptr.data(), b.kv_page_indptr.size() * 4);
    put(page_ids, b.page_ids.data(), b.page_ids.size() * 4);
    put(kv_len, b.kv_len.data(), b.kv_len.size() * 4);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    view.num_seqs = b.num_seqs();
    view.num_tokens = b.num_tokens();
  }
};

struct Comparison {
  double max_abs = 0;
  double rel_l2 = 0;
  int64_t checked = 0, bad = 0, nan_rows = 0;
  std::string first_bad;
};

// The checked rows of `gpu_out` [T, Hq, D] vs the reference (see the file comment for the sampling).
Comparison compare_with_reference(const HostBatch& b, const Pool& pool, const std::vector<uint16_t>& gpu_out,
                                  uint64_t seed) {
  Comparison c;
  const int64_t row = int64_t(b.num_heads) * kHeadDim;
  for (int64_t t = 0; t < b.num_tokens(); ++t) {
    for (int64_t e = 0; e < row; ++e) {
      if (std::isnan(model::bf16_bits_to_f32(gpu_out[size_t(t * row + e)]))) {
        ++c.nan_rows;
        break;
      }
    }
  }
  // One-query sub-batch: pick (s, i) -> sequence of length kv_len - n + i + 1 over s's pages.
  std::vector<int32_t> q_indptr{0}, kv_page_indptr{0}, page_ids, kv_len;
  std::vector<uint16_t> q;
  std::vector<int64_t> rows;  // token index in the batch of each pick
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (int s = 0; s < b.num_seqs(); ++s) {
    const int n = b.q_indptr[s + 1] - b.q_indptr[s];
    std::vector<int> picks;
    if (n <= kFullCheckQueries) {
      for (int i = 0; i < n; ++i) picks.push_back(i);
    } else {
      std::vector<int> all(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) all[i] = i;
      std::shuffle(all.begin() + 1, all.end() - 1, rng);
      picks = {0, n - 1};
      picks.insert(picks.end(), all.begin() + 1, all.begin() + (kSampledQueries - 1));
    }
    for (const int i : picks) {
      const int64_t t = b.q_indptr[s] + i;
      rows.push_back(t);
      q.insert(q.end(), b.q.begin() + t * row, b.q.begin() + (t + 1) * row);
      q_indptr.push_back(q_indptr.back() + 1);
      page_ids.insert(page_ids.end(), b.page_ids.begin() + b.kv_page_indptr[s], b.page_ids.begin() + b.kv_page_indptr[s + 1]);
      kv_page_indptr.push_back(int32_t(page_ids.size()));
      kv_len.push_back(b.kv_len[s] - n + i + 1);
    }
  }
  gpu::reference::AttentionInputs in;
  in.q = q;
  in.k_pool = pool.k;
  in.v_pool = pool.v;
  in.q_indptr = q_indptr;
  in.kv_page_indptr = kv_page_indptr;
  in.page_ids = page_ids;
  in.kv_len = kv_len;
  in.num_heads = b.num_heads;
  in.num_kv_heads = kNumKvHeads;
  in.head_dim = kHeadDim;
  in.page_size = kPageSize;
  in.sm_scale = kSmScale;
  std::vector<uint16_t> ref(q.size());
  gpu::reference::paged_attention(in, ref);

  double diff2 = 0, ref2 = 0;
  for (size_t k = 0; k < rows.size(); ++k) {
    for (int64_t e = 0; e < row; ++e) {
      const double expected = model::bf16_bits_to_f32(ref[k * row + e]);
      const double actual = model::bf16_bits_to_f32(gpu_out[size_t(rows[k] * row + e)]);
      const double d = std::abs(actual - expected);
      ++c.checked;
      diff2 += std::isnan(d) ? INFINITY : d * d;
      ref2 += expected * expected;
      c.max_abs = std::max(c.max_abs, std::isnan(d) ? INFINITY : d);
      if (!(d <= kAbsTolerance + kRelTolerance * std::abs(expected))) {
        if (c.bad++ == 0) {
          c.first_bad = "token " + std::to_string(rows[k]) + " head " + std::to_string(e / kHeadDim) + " dim " +
                        std::to_string(e % kHeadDim) + ": " + std::to_string(actual) + " vs " + std::to_string(expected);
        }
      }
    }
  }
  c.rel_l2 = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  return c;
}

void expect_matches_reference(const HostBatch& b, const Pool& pool, const std::vector<uint16_t>& out,
                              const std::string& what) {
  const Comparison c = compare_with_reference(b, pool, out, 99);
  std::printf("[ flashinfer ] %-40s %d seqs %d tokens: %lld values checked, max abs %.3e, rel L2 %.3e\n",
              what.c_str(), b.num_seqs(), b.num_tokens(), (long long)c.checked, c.max_abs, c.rel_l2);
  EXPECT_EQ(c.nan_rows, 0) << what << ": rows with NaN (unwritten or broken)";
  EXPECT_EQ(c.bad, 0) << what << ": " << c.bad << " values out of tolerance, first " << c.first_bad;
  EXPECT_LE(c.rel_l2, kRelL2Tolerance) << what;
}

std::vector<SeqSpec> decode_seqs(int num_seqs, int max_kv, uint64_t seed, int spare_every = 0) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_int_distribution<int> len(1, max_kv);
  std::vector<SeqSpec> seqs;
  for (int s = 0; s < num_seqs; ++s) {
    seqs.push_back({1, len(rng), spare_every > 0 && s % spare_every == 0 ? 1 + s % 3 : 0});
  }
  return seqs;
}

int total_tokens(const std::vector<SeqSpec>& seqs) {
  int t = 0;
  for (const SeqSpec& s : seqs) t += s.q_len;
  return t;
}

// Param: the GQA group (num_heads = group * 4 KV heads).
class FlashInferAttentionTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) {
      GTEST_SKIP() << "no CUDA device: the FlashInfer attention tests need an sm_90 GPU";
    }
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
    }
  }

  int num_heads() const { return GetParam() * kNumKvHeads; }

  void poison(const DeviceBatch& db) {
    ASSERT_EQ(cudaMemsetAsync(db.out.as<void>(), 0xFF, db.out.bytes(), stream_), cudaSuccess);
  }
  std::vector<uint16_t> download(const DeviceBatch& db, const HostBatch& b) {
    std::vector<uint16_t> out(b.out_elems());
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(out.data(), db.out.as<void>(), out.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  // plan + one eager run into poisoned outputs.
  std::vector<uint16_t> plan_and_run(FlashInferAttention& attn, const HostBatch& b, DeviceBatch& db, bool graph_plan) {
    attn.plan(b.q_indptr, b.kv_page_indptr, b.kv_len, graph_plan, stream_);
    poison(db);
    attn.run(db.view, stream_);
    return download(db, b);
  }

  // One case: fresh pool and batch, a plain plan, the expected kernel, the reference.
  void check_case(const std::vector<SeqSpec>& seqs, Kernel expected_kernel, const std::string& what, uint64_t seed) {
    SCOPED_TRACE(what);
    const int pool_pages = pages_needed(seqs) * 5 / 4 + 3;  // unused pages scattered among the used ones
    const Pool pool = make_pool(pool_pages, seed);
    const HostBatch b = make_batch(seqs, num_heads(), pool_pages, seed + 10);
    DeviceBatch db(pool, b.num_tokens(), b.num_seqs(), num_heads());
    db.load(b, stream_);
    FlashInferAttention attn(num_heads(), kNumKvHeads, kHeadDim, kPageSize, std::max(b.num_tokens(), 1),
                             b.num_seqs(), 0);
    const std::vector<uint16_t> out = plan_and_run(attn, b, db, false);
    EXPECT_EQ(attn.planned_kernel(), expected_kernel);
    expect_matches_reference(b, pool, out, what + " g" + std::to_string(GetParam()));
  }

  cudaStream_t stream_ = nullptr;
};

// Pure decode batches: 1 sequence (1 and 3000 keys), 16 and 64 sequences of 1..3000 keys, spare pages on some.
TEST_P(FlashInferAttentionTest, DecodeMatchesReference) {
  check_case({{1, 1}}, Kernel::kDecode, "decode 1 seq kv 1", 1);
  check_case({{1, 3000, 2}}, Kernel::kDecode, "decode 1 seq kv 3000", 2);
  check_case(decode_seqs(16, 3000, 3), Kernel::kDecode, "decode 16 seqs kv 1..3000", 3);
  check_case(decode_seqs(64, 3000, 4, 3), Kernel::kDecode, "decode 64 seqs kv 1..3000 spare pages", 4);
}

// Prefill-only (fresh prompts: query 0 sees one key), chunks continuing a cache, and mixed ragged batches with
// decode tokens, a sequence with no query this step and spare pages.
TEST_P(FlashInferAttentionTest, PrefillMatchesReference) {
  check_case({{7, 7}, {33, 33}, {1100, 1100}}, Kernel::kPrefill, "prefill fresh 7/33/1100", 11);
  check_case({{33, 533}, {1000, 2777, 1}}, Kernel::kPrefill, "prefill chunks on a cache", 12);
  check_case({{1, 2000}, {7, 107}, {1, 1}, {0, 300, 1}, {33, 33}, {1, 500, 2}, {1030, 1280}}, Kernel::kPrefill,
             "mixed ragged", 13);
  check_case({{2, 2}}, Kernel::kPrefill, "prefill 1 seq of 2", 14);
}

// A batch with no query token plans the empty kernel; run() writes nothing.
TEST_P(FlashInferAttentionTest, EmptyBatchRunsNothing) {
  const std::vector<SeqSpec> seqs{{0, 40}, {0, 0}};
  const Pool pool = make_pool(8, 21);
  const HostBatch b = make_batch(seqs, num_heads(), 8, 22);
  DeviceBatch db(pool, 1, 2, num_heads());
  db.load(b, stream_);
  FlashInferAttention attn(num_heads(), kNumKvHeads, kHeadDim, kPageSize, 1, 2, 0);
  attn.plan(b.q_indptr, b.kv_page_indptr, b.kv_len, false, stream_);
  EXPECT_EQ(attn.planned_kernel(), Kernel::kNone);
  attn.run(db.view, stream_);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

// CUDA-graph decode, two "layers" (different q and out, one plan): capture, replay == eager under the same graph
// plan (bitwise) and the reference; new lengths (same batch size) re-planned, replayed: again bitwise == eager and
// the reference; back to the first lengths: the first replay's bits.
TEST_P(FlashInferAttentionTest, CudaGraphDecodeReplay) {
  constexpr int kSeqs = 16;
  const Pool pool = make_pool(kSeqs * (3000 / kPageSize + 2) + 16, 31);
  const HostBatch a0 = make_batch(decode_seqs(kSeqs, 2500, 32, 4), num_heads(), pool.num_pages, 33);
  HostBatch a1 = a0;
  a1.q = random_bf16(a0.q.size(), 34, -2.0f, 2.0f);
  const HostBatch b0 = make_batch(decode_seqs(kSeqs, 3000, 35, 5), num_heads(), pool.num_pages, 36);
  HostBatch b1 = b0;
  b1.q = random_bf16(b0.q.size(), 37, -2.0f, 2.0f);
  DeviceBatch layer0(pool, kSeqs, kSeqs, num_heads()), layer1(pool, kSeqs, kSeqs, num_heads());
  FlashInferAttention attn(num_heads(), kNumKvHeads, kHeadDim, kPageSize, kSeqs, kSeqs, 0);
  const std::string g = " g" + std::to_string(GetParam());

  const auto eager_pair = [&](const HostBatch& h0, const HostBatch& h1, bool graph_plan) {
    attn.plan(h0.q_indptr, h0.kv_page_indptr, h0.kv_len, graph_plan, stream_);
    poison(layer0);
    poison(layer1);
    attn.run(layer0.view, stream_);
    attn.run(layer1.view, stream_);
    return std::pair{download(layer0, h0), download(layer1, h1)};
  };
  layer0.load(a0, stream_);
  layer1.load(a1, stream_);
  const auto [eager_a0, eager_a1] = eager_pair(a0, a1, true);
  EXPECT_EQ(attn.planned_kernel(), Kernel::kDecode);

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  attn.run(layer0.view, stream_);
  attn.run(layer1.view, stream_);
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  const auto replay = [&](const HostBatch& h0, const HostBatch& h1) {
    poison(layer0);
    poison(layer1);
    EXPECT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    return std::pair{download(layer0, h0), download(layer1, h1)};
  };

  const auto [replay_a0, replay_a1] = replay(a0, a1);
  EXPECT_TRUE(replay_a0 == eager_a0) << "replay vs eager, lengths A, layer 0";
  EXPECT_TRUE(replay_a1 == eager_a1) << "replay vs eager, lengths A, layer 1";
  expect_matches_reference(a0, pool, replay_a0, "graph decode A layer 0" + g);
  expect_matches_reference(a1, pool, replay_a1, "graph decode A layer 1" + g);

  // New lengths and pages in the same device buffers, re-planned on the host, replayed.
  layer0.load(b0, stream_);
  layer1.load(b1, stream_);
  attn.plan(b0.q_indptr, b0.kv_page_indptr, b0.kv_len, true, stream_);
  const auto [replay_b0, replay_b1] = replay(b0, b1);
  const auto [eager_b0, eager_b1] = eager_pair(b0, b1, true);
  EXPECT_TRUE(replay_b0 == eager_b0) << "replay vs eager, lengths B, layer 0";
  EXPECT_TRUE(replay_b1 == eager_b1) << "replay vs eager, lengths B, layer 1";
  expect_matches_reference(b0, pool, replay_b0, "graph decode B layer 0" + g);
  expect_matches_reference(b1, pool, replay_b1, "graph decode B layer 1" + g);
  const auto [plain_b0, plain_b1] = eager_pair(b0, b1, false);
  expect_matches_reference(b0, pool, plain_b0, "plain-plan decode B layer 0" + g);
  std::printf("[ flashinfer ] plain-plan eager run %s the graph replay bitwise\n",
              plain_b0 == replay_b0 ? "equals" : "differs from");

  // Back to lengths A: the same bits as the first replay.
  layer0.load(a0, stream_);
  layer1.load(a1, stream_);
  attn.plan(a0.q_indptr, a0.kv_page_indptr, a0.kv_len, true, stream_);
  const auto [again_a0, again_a1] = replay(a0, a1);
  EXPECT_TRUE(again_a0 == replay_a0) << "second replay of lengths A, layer 0";
  EXPECT_TRUE(again_a1 == replay_a1) << "second replay of lengths A, layer 1";

  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

// CUDA-graph SM90 prefill over a mixed batch: 4 sequences / 242 tokens in both steps, the split of the tokens over
// the sequences and the cache lengths change between them. Replays == eager under the same plan, and the reference.
TEST_P(FlashInferAttentionTest, CudaGraphPrefillReplay) {
  const std::vector<SeqSpec> step_a{{1, 900}, {1, 5}, {40, 140}, {200, 200}};
  const std::vector<SeqSpec> step_b{{100, 100}, {1, 2000, 1}, {41, 41}, {100, 700}};
  ASSERT_EQ(total_tokens(step_a), total_tokens(step_b));
  const int tokens = total_tokens(step_a), seqs = 4;
  const Pool pool = make_pool(std::max(pages_needed(step_a), pages_needed(step_b)) + 20, 41);
  const HostBatch a = make_batch(step_a, num_heads(), pool.num_pages, 42);
  const HostBatch b = make_batch(step_b, num_heads(), pool.num_pages, 43);
  DeviceBatch db(pool, tokens, seqs, num_heads());
  FlashInferAttention attn(num_heads(), kNumKvHeads, kHeadDim, kPageSize, tokens, seqs, 0);
  const std::string g = " g" + std::to_string(GetParam());

  db.load(a, stream_);
  const std::vector<uint16_t> eager_a = plan_and_run(attn, a, db, true);
  EXPECT_EQ(attn.planned_kernel(), Kernel::kPrefill);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  attn.run(db.view, stream_);
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  const auto replay = [&](const HostBatch& h) {
    poison(db);
    EXPECT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    return download(db, h);
  };
  const std::vector<uint16_t> replay_a = replay(a);
  EXPECT_TRUE(replay_a == eager_a) << "replay vs eager, step A";
  expect_matches_reference(a, pool, replay_a, "graph prefill A" + g);

  db.load(b, stream_);
  attn.plan(b.q_indptr, b.kv_page_indptr, b.kv_len, true, stream_);
  const std::vector<uint16_t> replay_b = replay(b);
  const std::vector<uint16_t> eager_b = plan_and_run(attn, b, db, true);
  EXPECT_TRUE(replay_b == eager_b) << "replay vs eager, step B";
  expect_matches_reference(b, pool, replay_b, "graph prefill B" + g);

  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

// A re-plan that would change what a captured run() baked in throws; so does capturing after a plain plan.
TEST_P(FlashInferAttentionTest, CapturedLayoutIsEnforced) {
  const std::vector<SeqSpec> decode{{1, 50}, {1, 60}, {1, 70}, {1, 80}};
  const Pool pool = make_pool(pages_needed(decode) + 8, 51);
  const HostBatch a = make_batch(decode, num_heads(), pool.num_pages, 52);
  DeviceBatch db(pool, 8, 4, num_heads());
  db.load(a, stream_);
  FlashInferAttention attn(num_heads(), kNumKvHeads, kHeadDim, kPageSize, 8, 4, 0);

  // Capture after a plain plan: refused before anything is enqueued.
  attn.plan(a.q_indptr, a.kv_page_indptr, a.kv_len, false, stream_);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_THROW(attn.run(db.view, stream_), Error);
  EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  if (graph != nullptr) {
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
  graph = nullptr;

  attn.plan(a.q_indptr, a.kv_page_indptr, a.kv_len, true, stream_);
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  attn.run(db.view, stream_);
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  // plan() itself under capture is refused.
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_THROW(attn.plan(a.q_indptr, a.kv_page_indptr, a.kv_len, true, stream_), Error);
  cudaGraph_t unused = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream_, &unused), cudaSuccess);
  if (unused != nullptr) {
    EXPECT_EQ(cudaGraphDestroy(unused), cudaSuccess);
  }

  // Same sizes, other lengths: fine. A sequence with 2 queries (prefill kernel, 5 tokens): refused. 3 sequences:
  // refused. A plain plan is always allowed.
  // (planned only, never run: its page ids may lie beyond this test's pool)
  const HostBatch longer = make_batch({{1, 500}, {1, 1}, {1, 70}, {1, 300}}, num_heads(), pool.num_pages + 40, 53);
  EXPECT_NO_THROW(attn.plan(longer.q_indptr, longer.kv_page_indptr, longer.kv_len, true, stream_));
  const HostBatch two_queries = make_batch({{2, 50}, {1, 60}, {1, 70}, {1, 80}}, num_heads(), pool.num_pages, 54);
  EXPECT_THROW(attn.plan(two_queries.q_indptr, two_queries.kv_page_indptr, two_queries.kv_len, true, stream_), Error);
  const HostBatch three = make_batch({{1, 50}, {1, 60}, {1, 70}}, num_heads(), pool.num_pages, 55);
  EXPECT_THROW(attn.plan(three.q_indptr, three.kv_page_indptr, three.kv_len, true, stream_), Error);
  EXPECT_NO_THROW(attn.plan(three.q_indptr, three.kv_page_indptr, three.kv_len, false, stream_));
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  // With the graph gone, a graph plan of other sizes is allowed again.
  attn.release_captured_graph();
  EXPECT_NO_THROW(attn.plan(three.q_indptr, three.kv_page_indptr, three.kv_len, true, stream_));
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

// Host validation: each bad batch throws a one-line fulcrum::Error; run() must match the plan.
TEST_P(FlashInferAttentionTest, PlanRejectsInvalidBatches) {
  FlashInferAttention attn(num_heads(), kNumKvHeads, kHeadDim, kPageSize, 64, 4, 0);
  using V = std::vector<int32_t>;
  const auto plan = [&](const V& q, const V& pages, const V& kv) { attn.plan(q, pages, kv, false, stream_); };
  const Pool pool = make_pool(8, 61);
  DeviceBatch db(pool, 64, 4, num_heads());
  EXPECT_THROW(attn.run(db.view, stream_), Error) << "run before plan";
  EXPECT_THROW(plan({0, 5}, {0, 1}, {3}), Error) << "more queries than kv_len";
  EXPECT_THROW(plan({0, 1}, {0, 1}, {17}), Error) << "too few pages";
  EXPECT_THROW(plan({1, 2}, {0, 1}, {5}), Error) << "q_indptr[0] != 0";
  EXPECT_THROW(plan({0, 1}, {0, 1}, {5, 5}), Error) << "indptr sizes";
  EXPECT_THROW(plan({0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 5}, {1, 1, 1, 1, 1}), Error) << "more than max_seqs";
  EXPECT_THROW(plan({0, 65}, {0, 5}, {65}), Error) << "more than max_tokens";
  EXPECT_THROW(plan({0, 2, 1}, {0, 1, 2}, {2, 2}), Error) << "decreasing q_indptr";
  try {
    plan({0, 1}, {0, 1}, {17});
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
  // A valid plan, then a run whose batch has other sizes.
  EXPECT_NO_THROW(plan({0, 1, 2}, {0, 1, 2}, {3, 16}));
  db.view.num_seqs = 2;
  db.view.num_tokens = 3;
  EXPECT_THROW(attn.run(db.view, stream_), Error) << "batch tokens differ from the plan";
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

INSTANTIATE_TEST_SUITE_P(GqaGroups, FlashInferAttentionTest, ::testing::Values(1, 4, 8, 16),
                         [](const ::testing::TestParamInfo<int>& info) { return "group" + std::to_string(info.param); });

// No GPU needed: which shapes are supported, and the constructor refuses the others before touching CUDA.
TEST(FlashInferAttentionSupportsTest, ShapesAndGroups) {
  EXPECT_TRUE(FlashInferAttention::supports(128, 32, 4));
  EXPECT_TRUE(FlashInferAttention::supports(128, 64, 4));
  EXPECT_TRUE(FlashInferAttention::supports(128, 4, 4));
  EXPECT_TRUE(FlashInferAttention::supports(128, 16, 4));
  EXPECT_FALSE(FlashInferAttention::supports(64, 32, 4));
  EXPECT_FALSE(FlashInferAttention::supports(256, 32, 4));
  EXPECT_FALSE(FlashInferAttention::supports(128, 48, 4));   // group 12
  EXPECT_FALSE(FlashInferAttention::supports(128, 128, 4));  // group 32
  EXPECT_FALSE(FlashInferAttention::supports(128, 30, 4));
  EXPECT_FALSE(FlashInferAttention::supports(128, 32, 0));
  EXPECT_THROW(FlashInferAttention(48, 4, 128, 16, 64, 4, 0), Error);
  EXPECT_THROW(FlashInferAttention(32, 4, 64, 16, 64, 4, 0), Error);
  EXPECT_THROW(FlashInferAttention(32, 4, 128, 16, 600000, 4, 0), Error);  // beyond the per-head SM90 schedule
}

}  // namespace
}  // namespace fulcrum::test
