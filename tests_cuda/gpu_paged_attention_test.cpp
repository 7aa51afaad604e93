// The engine's paged attention kernels (src/gpu/kernels/paged_attention.hpp) against the CPU reference
// gpu::reference::paged_attention on fresh random bf16 inputs: ragged mixed batches (query lengths 1, 2, 7, 16,
// 33, 1030, sequences with 0 new tokens, prefill chunks continuing a cache: kv_len > n_s, padding tokens after
// the last sequence), pure decode batches (1, 4 and 64 sequences, contexts 1..3000), head_dim 16 / 32 / 64 / 128
// / 256, groups 1 / 2 / 4 / 8 / 16, page sizes 1 / 7 / 16 / 64 with scattered, non-ascending page ids and
// garbage in every pool row no sequence owns. Each batch runs on the tensor-core kernels (head_dim 64 / 128)
// and on the forced CUDA-core fallback. Outputs are poisoned (bf16 NaN) first: every element of every sequence's
// tokens must be written, padding tokens must stay untouched. Also: the same keys in other pages (and another
// page size) give bitwise the same output; a captured CUDA graph replayed with new lengths; the plan.
//
// Tolerance, element-wise: |gpu - ref| <= 2^-7 |ref| + abs, abs = 2^-12 max|v| (CUDA cores) or 2^-7 max|v|
// (tensor cores); and ||gpu - ref|| / ||ref|| <= 1e-3 (CUDA cores) or 1e-2 (tensor cores).
//   - Both sides round an fp32 result to bf16 (8 significant bits). Where the fp32 values differ a little and
//     straddle a rounding boundary they land one bf16 ulp apart, and an ulp is at most 2^-7 of the value.
//   - CUDA cores: scores, softmax and P V in fp32 like the reference, only the summation order differs (fma,
//     key tiles, splits merged by their log-sum-exp): ~1e-6 relative, far inside 2^-12 of the largest value.
//   - Tensor cores: P is rounded to bf16 (relative error <= 2^-8) before P V, and l sums the rounded weights, so
//     the output is a weighted mean with weights off by <= 2^-7 relative: |error| <= 2^-7 sum_j w_j |v_j - c|
//     <= 2^-7 max|v| (c the midrange). That is the bound above; random roundings make the typical error
//     ~1e-3 of the output's norm (measured norms are printed), hence the 1e-2 norm bound.
// A wrong key set (causal off by one, a split or page boundary dropped) moves outputs by ~|v| / (attended
// keys) at the queries it touches; the inputs make attention peaky (q scaled so scores spread over several
// units), which keeps that far above both bounds.
#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/kernels/attention_batch.hpp"
#include "gpu/kernels/paged_attention.hpp"
#include "gpu/reference/attention_reference.hpp"
#include "model/checkpoint_writer.hpp"

namespace fulcrum::test {
namespace {

using gpu::PagedAttentionPlan;
using gpu::PagedAttentionShape;

constexpr uint16_t kPoison = 0xffff;  // a bf16 NaN

// A device allocation (RAII) with host copies in and out.
class Buffer {
 public:
  explicit Buffer(size_t bytes) : bytes_(bytes) { EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)), cudaSuccess); }
  template <typename T>
  explicit Buffer(const std::vector<T>& host) : Buffer(sizeof(T) * host.size()) {
    write(host);
  }
  ~Buffer() { cudaFree(ptr_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <typename T>
  void write(const std::vector<T>& host) {
    ASSERT_EQ(sizeof(T) * host.size(), bytes_);
    ASSERT_EQ(cudaMemcpy(ptr_, host.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  template <typename T>
  std::vector<T> read() const {
    std::vector<T> host(bytes_ / sizeof(T));
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

uint64_t mix(uint64_t z) {  // SplitMix64's finalizer: a hash of an index
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// bf16 bits of a value uniform in [-scale, scale), a function of (seed, index).
uint16_t random_bf16(uint64_t seed, uint64_t index, float scale) {
  const double u = static_cast<double>(mix(seed * 0x100000001b3ULL ^ mix(index)) >> 11) * 0x1.0p-53;
  return model::f32_to_bf16_bits(static_cast<float>((2.0 * u - 1.0) * scale));
}

struct Seq {
  int n;       // new query tokens
  int kv_len;  // positions after this step's append (>= n)
};

struct BatchSpec {
  std::vector<Seq> seqs;
  int num_kv_heads = 1, group = 1, head_dim = 128, page_size = 16;
  float q_scale = 4.0f;       // q uniform in [-q_scale, q_scale): scores spread over several units
  int padding_tokens = 0;     // tokens after the last sequence's (a padded bucket): must stay untouched
  int capacity_kv = 0;        // > 0: every sequence owns pages for this many positions (fixed table sizes)
  uint64_t value_seed = 1;    // q, k, v values
  uint64_t layout_seed = 1;   // page ids and the garbage in rows no sequence uses
  std::string name() const {
    return fmt::format("{}seqs_Hkv{}_G{}_D{}_page{}", seqs.size(), num_kv_heads, group, head_dim, page_size);
  }
};

// Host copies of one AttentionBatch. Position p of sequence s, kv head h holds the same values whatever the
// layout: they are hashed from (value_seed, s, p, h, d); page ids are a shuffle of all pages.
struct HostBatch {
  BatchSpec spec;
  int num_tokens = 0, num_heads = 0;
  float sm_scale = 0;
  std::vector<uint16_t> q, k_pool, v_pool;
  std::vector<int32_t> q_indptr, kv_page_indptr, page_ids, kv_len;
  float max_abs_v = 0;
};

HostBatch make_batch(const BatchSpec& spec) {
  HostBatch b;
  b.spec = spec;
  const int D = spec.head_dim, Hkv = spec.num_kv_heads, P = spec.page_size;
  b.num_heads = Hkv * spec.group;
  b.sm_scale = 1.0f / std::sqrt(static_cast<float>(D));
  b.q_indptr.push_back(0);
  b.kv_page_indptr.push_back(0);
  for (const Seq& s : spec.seqs) {
    b.q_indptr.push_back(b.q_indptr.back() + s.n);
    b.kv_len.push_back(s.kv_len);
    const int pages = (std::max(s.kv_len, spec.capacity_kv) + P - 1) / P;
    b.kv_page_indptr.push_back(b.kv_page_indptr.back() + pages);
  }
  b.num_tokens = b.q_indptr.back() + spec.padding_tokens;
  const int used_pages = b.kv_page_indptr.back(), num_pages = used_pages + 3;  // 3 pages nobody owns
  std::vector<int32_t> perm(static_cast<size_t>(num_pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(static_cast<uint32_t>(spec.layout_seed));
  std::shuffle(perm.begin(), perm.end(), rng);
  b.page_ids.assign(perm.begin(), perm.begin() + used_pages);

  const int64_t row_elems = static_cast<int64_t>(Hkv) * D;
  const size_t pool = static_cast<size_t>(num_pages) * P * row_elems;
  b.k_pool.resize(pool);
  b.v_pool.resize(pool);
  for (size_t i = 0; i < pool; ++i) {  // garbage first (layout-dependent); owned positions overwritten below
    b.k_pool[i] = random_bf16(1000 + spec.layout_seed, i, 1.0f);
    b.v_pool[i] = random_bf16(2000 + spec.layout_seed, i, 1.0f);
  }
  for (size_t s = 0; s < spec.seqs.size(); ++s) {
    for (int p = 0; p < spec.seqs[s].kv_len; ++p) {
      const int64_t row = static_cast<int64_t>(b.page_ids[b.kv_page_indptr[s] + p / P]) * P + p % P;
      for (int64_t e = 0; e < row_elems; ++e) {
        const uint64_t index = ((static_cast<uint64_t>(s) << 24 | static_cast<uint64_t>(p)) << 12) | static_cast<uint64_t>(e);
        b.k_pool[row * row_elems + e] = random_bf16(3 * spec.value_seed, index, 1.0f);
        b.v_pool[row * row_elems + e] = random_bf16(3 * spec.value_seed + 1, index, 1.0f);
      }
    }
  }
  for (const uint16_t v : b.v_pool) b.max_abs_v = std::max(b.max_abs_v, std::abs(model::bf16_bits_to_f32(v)));
  b.q.resize(static_cast<size_t>(b.num_tokens) * b.num_heads * D);
  for (size_t i = 0; i < b.q.size(); ++i) b.q[i] = random_bf16(3 * spec.value_seed + 2, i, spec.q_scale);
  return b;
}

std::vector<uint16_t> reference_output(const HostBatch& b) {
  gpu::reference::AttentionInputs in;
  in.q = b.q;
  in.k_pool = b.k_pool;
  in.v_pool = b.v_pool;
  in.q_indptr = b.q_indptr;
  in.kv_page_indptr = b.kv_page_indptr;
  in.page_ids = b.page_ids;
  in.kv_len = b.kv_len;
  in.num_heads = b.num_heads;
  in.num_kv_heads = b.spec.num_kv_heads;
  in.head_dim = b.spec.head_dim;
  in.page_size = b.spec.page_size;
  in.sm_scale = b.sm_scale;
  std::vector<uint16_t> out(b.q.size(), kPoison);
  gpu::reference::paged_attention(in, out);
  return out;
}

int num_sms() {
  int device = 0, sms = 0;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  return std::max(sms, 1);
}

PagedAttentionShape shape_of(const HostBatch& b, bool force_cuda_cores, int max_q_len = -1) {
  PagedAttentionShape s;
  s.num_seqs = static_cast<int>(b.spec.seqs.size());
  s.num_tokens = b.num_tokens;
  s.num_heads = b.num_heads;
  s.num_kv_heads = b.spec.num_kv_heads;
  s.head_dim = b.spec.head_dim;
  s.max_kv_len = std::max(1, *std::max_element(b.kv_len.begin(), b.kv_len.end()));
  s.max_kv_len = std::max(s.max_kv_len, b.spec.capacity_kv);
  s.max_q_len = max_q_len;
  s.num_sms = num_sms();
  s.max_cluster = gpu::paged_attention_max_cluster();
  s.force_cuda_cores = force_cuda_cores;
  return s;
}

// The batch's arrays on the device, with the AttentionBatch view of them.
struct DeviceBatch {
  explicit DeviceBatch(const HostBatch& b)
      : q(b.q), out(sizeof(uint16_t) * b.q.size()), k_pool(b.k_pool), v_pool(b.v_pool), q_indptr(b.q_indptr),
        kv_page_indptr(b.kv_page_indptr), page_ids(b.page_ids), kv_len(b.kv_len),
        split_counters(sizeof(int32_t) * std::max<size_t>(1, b.spec.seqs.size() * b.spec.num_kv_heads)) {
    EXPECT_EQ(cudaMemset(split_counters.as<void>(), 0, split_counters.bytes()), cudaSuccess);
    view.split_counters = split_counters.as<int32_t>();
    view.q = q.as<uint16_t>();
    view.out = out.as<uint16_t>();
    view.k_pool = k_pool.as<uint16_t>();
    view.v_pool = v_pool.as<uint16_t>();
    view.q_indptr = q_indptr.as<int32_t>();
    view.kv_page_indptr = kv_page_indptr.as<int32_t>();
    view.page_ids = page_ids.as<int32_t>();
    view.kv_len = kv_len.as<int32_t>();
    view.num_seqs = static_cast<int>(b.spec.seqs.size());
    view.num_tokens = b.num_tokens;
    view.num_heads = b.num_heads;
    view.num_kv_heads = b.spec.num_kv_heads;
    view.head_dim = b.spec.head_dim;
    view.page_size = b.spec.page_size;
    view.sm_scale = b.sm_scale;
  }
  // Same shapes, new contents (a graph replay's next step).
  void rewrite(const HostBatch& b) {
    q.write(b.q);
    k_pool.write(b.k_pool);
    v_pool.write(b.v_pool);
    q_indptr.write(b.q_indptr);
    kv_page_indptr.write(b.kv_page_indptr);
    page_ids.write(b.page_ids);
    kv_len.write(b.kv_len);
  }
  void poison() { ASSERT_EQ(cudaMemset(out.as<void>(), 0xff, out.bytes()), cudaSuccess); }
  // The launch contract: the decode splits' counters are left zero for the next launch.
  int64_t nonzero_counters() const {
    const std::vector<int32_t> c = split_counters.read<int32_t>();
    return std::count_if(c.begin(), c.end(), [](int32_t v) { return v != 0; });
  }
  Buffer q, out, k_pool, v_pool, q_indptr, kv_page_indptr, page_ids, kv_len, split_counters;
  gpu::AttentionBatch view;
};

int64_t count_differences(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  if (a.size() != b.size()) return -1;
  int64_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
  return differ;
}

class GpuPagedAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the paged attention tests need a GPU";
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Poisons the output, plans, launches, returns the output.
  // `adjust` may change the plan before the launch (another decode path for the same splits).
  std::vector<uint16_t> run(const HostBatch& b, bool force_cuda_cores, int max_q_len = -1,
                            const std::function<void(PagedAttentionPlan&)>& adjust = {}) {
    DeviceBatch d(b);
    d.poison();
    PagedAttentionPlan plan = gpu::plan_paged_attention(shape_of(b, force_cuda_cores, max_q_len));
    if (adjust) adjust(plan);
    EXPECT_EQ(plan.tensor_cores, !force_cuda_cores && (b.spec.head_dim == 64 || b.spec.head_dim == 128));
    Buffer workspace(gpu::paged_attention_workspace_bytes(plan));
    EXPECT_EQ(gpu::launch_paged_attention(d.view, plan, workspace.as<void>(), workspace.bytes(), stream_), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(d.nonzero_counters(), 0) << "decode split counters not reset";
    return d.out.read<uint16_t>();
  }

  // Element-wise and norm bounds of the file comment; every element of the sequences' tokens written (finite),
  // padding tokens untouched.
  void expect_matches(const HostBatch& b, const std::vector<uint16_t>& gpu_out, const std::vector<uint16_t>& ref,
                      bool tensor_cores, const std::string& what) {
    ASSERT_EQ(gpu_out.size(), ref.size()) << what;
    const size_t written = static_cast<size_t>(b.q_indptr.back()) * b.num_heads * b.spec.head_dim;
    const double abs_bound = (tensor_cores ? 0x1.0p-7 : 0x1.0p-12) * b.max_abs_v;
    const double norm_bound = tensor_cores ? 1e-2 : 1e-3;
    int64_t unwritten = 0, outside = 0, clobbered = 0;
    double diff2 = 0, ref2 = 0, worst = 0;
    size_t worst_at = 0;
    for (size_t i = 0; i < gpu_out.size(); ++i) {
      if (i >= written) {
        clobbered += gpu_out[i] != kPoison;
        continue;
      }
      const double g = model::bf16_bits_to_f32(gpu_out[i]), r = model::bf16_bits_to_f32(ref[i]);
      if (!std::isfinite(g)) {
        ++unwritten;
        continue;
      }
      const double err = std::abs(g - r), bound = 0x1.0p-7 * std::abs(r) + abs_bound;
      outside += err > bound;
      if (err / bound > worst) worst = err / bound, worst_at = i;
      diff2 += (g - r) * (g - r);
      ref2 += r * r;
    }
    const double norm_err = std::sqrt(diff2 / std::max(ref2, 1e-30));
    const size_t per_token = static_cast<size_t>(b.num_heads) * b.spec.head_dim;
    EXPECT_EQ(unwritten, 0) << what << ": elements left poisoned";
    EXPECT_EQ(outside, 0) << what << ": elements outside the bound; worst at token " << worst_at / per_token
                          << " head " << worst_at % per_token / b.spec.head_dim << " d " << worst_at % b.spec.head_dim
                          << ": gpu " << model::bf16_bits_to_f32(gpu_out[worst_at]) << " ref "
                          << model::bf16_bits_to_f32(ref[worst_at]);
    EXPECT_EQ(clobbered, 0) << what << ": padding tokens written";
    EXPECT_LE(norm_err, norm_bound) << what;
    std::printf("  %-60s norm error %.2e, worst error / bound %.3f\n", what.c_str(), norm_err, worst);
  }

  // Runs the batch on every path that serves its head_dim and checks each against the reference.
  void check_all_paths(const BatchSpec& spec) {
    SCOPED_TRACE(spec.name());
    const HostBatch b = make_batch(spec);
    const std::vector<uint16_t> ref = reference_output(b);
    const bool has_mma = spec.head_dim == 64 || spec.head_dim == 128;
    expect_matches(b, run(b, /*force_cuda_cores=*/true), ref, false, spec.name() + " cuda cores");
    if (!has_mma) return;
    const std::vector<uint16_t> tensor = run(b, false);
    expect_matches(b, tensor, ref, true, spec.name() + " tensor cores");
    // The other decode paths for the same splits: page ids and K / V read after the wait (the same arithmetic, so
    // the same bits), and splits merged through the workspace by the last CTA instead of inside a cluster.
    EXPECT_EQ(count_differences(run(b, false, -1, [](PagedAttentionPlan& p) { p.early_kv = false; }), tensor), 0)
        << "K / V read after the wait";
    expect_matches(b, run(b, false, -1, [](PagedAttentionPlan& p) { p.decode_cluster = 1; }), ref, true,
                   spec.name() + " tensor cores, splits merged through the workspace");
  }

  cudaStream_t stream_ = nullptr;
};

// The real shape of Qwen3-30B-A3B's attention (D 128, group 8) over a ragged batch: decode tokens, fresh
// prefills, chunks continuing a cache (one of 1030 tokens), sequences with no new token, padding tokens.
TEST_F(GpuPagedAttentionTest, RaggedMixedBatch) {
  BatchSpec spec;
  spec.seqs = {{1, 1}, {7, 7}, {33, 100}, {0, 50}, {1030, 1200}, {1, 3000}, {2, 2}, {0, 0}, {16, 80}, {1, 64}};
  spec.num_kv_heads = 1;
  spec.group = 8;
  spec.head_dim = 128;
  spec.page_size = 16;
  spec.padding_tokens = 3;
  check_all_paths(spec);
}

// Short chunks continuing long caches: few prefill tiles, so the plan splits their keys (prefill merge path).
TEST_F(GpuPagedAttentionTest, ShortChunksOnLongCaches) {
  BatchSpec spec;
  spec.seqs = {{33, 3000}, {7, 500}, {0, 20}, {2, 1999}};
  spec.num_kv_heads = 2;
  spec.group = 4;
  spec.head_dim = 64;
  spec.page_size = 64;
  spec.value_seed = 5;
  check_all_paths(spec);
}

// Pure decode: 1 sequence (split over many CTAs; 2048 and 4000 positions, 8 splits of 256 / 512 keys in one cluster),
// 4, and 64 with contexts 1..3000; groups 8 and 16.
TEST_F(GpuPagedAttentionTest, PureDecodeBatches) {
  std::mt19937 rng(77);
  for (const int num_seqs : {1, 4, 64}) {
    for (const int group : {8, 16}) {
      BatchSpec spec;
      std::uniform_int_distribution<int> len(1, 3000);
      for (int s = 0; s < num_seqs; ++s) spec.seqs.push_back({1, num_seqs == 1 ? (group == 8 ? 2048 : 4000) : (s == 0 ? 1 : len(rng))});
      spec.num_kv_heads = 4;
      spec.group = group;
      spec.head_dim = 128;
      spec.page_size = 16;
      spec.value_seed = 10 + num_seqs + group;
      check_all_paths(spec);
    }
  }
}

// Every head_dim, every group size, page sizes 1 / 16 / 64 on a small ragged batch.
TEST_F(GpuPagedAttentionTest, HeadDimsGroupsPageSizes) {
  struct Shape {
    int head_dim, group, num_kv_heads, page_size;
  };
  const std::vector<Shape> shapes = {{16, 1, 3, 1},  {16, 8, 1, 16},  {32, 16, 1, 64}, {32, 2, 2, 1},
                                     {64, 2, 2, 16}, {64, 8, 1, 1},   {64, 16, 1, 64}, {64, 1, 4, 16},
                                     {128, 1, 2, 1}, {128, 2, 2, 64}, {128, 4, 2, 16}, {128, 16, 1, 1},
                                     {256, 4, 2, 16}};
  for (const Shape& sh : shapes) {
    BatchSpec spec;
    spec.seqs = {{1, 37}, {5, 5}, {9, 200}, {0, 10}, {1, 1}, {40, 130}, {3, 64}, {1, 65}};
    spec.head_dim = sh.head_dim;
    spec.group = sh.group;
    spec.num_kv_heads = sh.num_kv_heads;
    spec.page_size = sh.page_size;
    spec.value_seed = 100 + sh.head_dim + sh.group;
    check_all_paths(spec);
  }
}

// The same keys in other pages, and at another page size: bitwise the same output on both paths.
TEST_F(GpuPagedAttentionTest, OutputDoesNotDependOnPageLayout) {
  BatchSpec spec;
  spec.seqs = {{1, 700}, {20, 300}, {0, 5}, {1, 2048}, {130, 130}};
  spec.num_kv_heads = 2;
  spec.group = 8;
  spec.head_dim = 128;
  spec.page_size = 16;
  BatchSpec moved = spec;
  moved.layout_seed = 9;
  BatchSpec repaged = spec;
  repaged.page_size = 7;
  repaged.layout_seed = 3;
  const HostBatch b = make_batch(spec), b_moved = make_batch(moved), b_repaged = make_batch(repaged);
  ASSERT_NE(b.page_ids, b_moved.page_ids);
  for (const bool force : {false, true}) {
    SCOPED_TRACE(force ? "cuda cores" : "tensor cores");
    const std::vector<uint16_t> out = run(b, force);
    EXPECT_EQ(count_differences(run(b_moved, force), out), 0) << "other pages";
    EXPECT_EQ(count_differences(run(b_repaged, force), out), 0) << "page size 7";
  }
}

// A decode bucket captured once in a CUDA graph, replayed with other lengths, values and page tables in the
// same device buffers (the plan's max_q_len 1 drops the prefill launch).
TEST_F(GpuPagedAttentionTest, CapturedGraphReplaysWithNewLengths) {
  BatchSpec first;
  first.seqs = {{1, 100}, {1, 2000}, {1, 1}, {1, 700}};
  first.num_kv_heads = 4;
  first.group = 8;
  first.head_dim = 128;
  first.page_size = 16;
  first.capacity_kv = 2048;  // the bucket's page tables, fixed
  BatchSpec second = first;
  second.seqs = {{1, 1500}, {1, 3}, {1, 2048}, {1, 64}};
  second.value_seed = 2;
  second.layout_seed = 4;
  const HostBatch b1 = make_batch(first), b2 = make_batch(second);
  for (const bool force : {false, true}) {
    SCOPED_TRACE(force ? "cuda cores" : "tensor cores");
    DeviceBatch d(b1);
    const PagedAttentionPlan plan = gpu::plan_paged_attention(shape_of(b1, force, /*max_q_len=*/1));
    EXPECT_EQ(plan.prefill_tiles, 0);
    Buffer workspace(gpu::paged_attention_workspace_bytes(plan));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const cudaError_t launched = gpu::launch_paged_attention(d.view, plan, workspace.as<void>(), workspace.bytes(), stream_);
    ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
    ASSERT_EQ(launched, cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (const HostBatch* b : {&b1, &b2, &b1}) {
      d.rewrite(*b);
      d.poison();
      ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      expect_matches(*b, d.out.read<uint16_t>(), reference_output(*b), !force, "graph replay");
      EXPECT_EQ(d.nonzero_counters(), 0) << "decode split counters not reset";
    }
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
}

// A batch the plan was not made for, or a short workspace, is refused before any launch.
TEST_F(GpuPagedAttentionTest, LauncherRefusesMismatches) {
  BatchSpec spec;
  spec.seqs = {{1, 300}, {4, 40}};
  spec.num_kv_heads = 2;
  spec.group = 8;
  const HostBatch b = make_batch(spec);
  DeviceBatch d(b);
  const PagedAttentionPlan plan = gpu::plan_paged_attention(shape_of(b, false));
  const size_t bytes = gpu::paged_attention_workspace_bytes(plan);
  ASSERT_GT(bytes, 0u);
  Buffer workspace(bytes);
  gpu::AttentionBatch other = d.view;
  other.num_tokens += 1;
  EXPECT_EQ(gpu::launch_paged_attention(other, plan, workspace.as<void>(), bytes, stream_), cudaErrorInvalidValue);
  other = d.view;
  other.page_size = 0;
  EXPECT_EQ(gpu::launch_paged_attention(other, plan, workspace.as<void>(), bytes, stream_), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::launch_paged_attention(d.view, plan, workspace.as<void>(), bytes - 1, stream_), cudaErrorInvalidValue);
  ASSERT_GT(plan.decode_splits, 1);
  PagedAttentionPlan no_cluster = plan;  // splits merged through the workspace need their counters
  no_cluster.decode_cluster = 1;
  const size_t no_cluster_bytes = gpu::paged_attention_workspace_bytes(no_cluster);
  Buffer no_cluster_workspace(no_cluster_bytes);
  other = d.view;
  other.split_counters = nullptr;
  EXPECT_EQ(gpu::launch_paged_attention(other, no_cluster, no_cluster_workspace.as<void>(), no_cluster_bytes, stream_),
            cudaErrorInvalidValue);
  PagedAttentionPlan bad_cluster = plan;  // a cluster must hold the splits of one (sequence, kv head)
  bad_cluster.decode_cluster = plan.decode_splits + 1;
  EXPECT_EQ(gpu::launch_paged_attention(d.view, bad_cluster, workspace.as<void>(), bytes, stream_), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::launch_paged_attention(d.view, plan, workspace.as<unsigned char>() + 16, bytes, stream_),
            cudaErrorInvalidValue);
  PagedAttentionShape odd = shape_of(b, false);
  odd.num_heads = 24;  // group 12: not a divisor of 16
  other = d.view;
  other.num_heads = 24;
  EXPECT_EQ(gpu::launch_paged_attention(other, gpu::plan_paged_attention(odd), workspace.as<void>(), bytes, stream_),
            cudaErrorInvalidValue);
}

// What the plan chooses for the real shapes (host only: no device needed).
TEST(PagedAttentionPlan, ChoosesSplitsAndTiles) {
  PagedAttentionShape s;
  s.num_seqs = 1;
  s.num_tokens = 1;
  s.num_heads = 32;
  s.num_kv_heads = 4;
  s.head_dim = 128;
  s.max_kv_len = 2048;
  s.max_q_len = 1;
  PagedAttentionPlan p = gpu::plan_paged_attention(s);
  EXPECT_TRUE(p.tensor_cores);
  // Up to 4096 planned positions the splits are cut to one cluster: 4 kv heads x 16 splits of 128 keys = 64 CTAs,
  // merged in DSMEM (no workspace), every tile in flight (4 stages: at most half the SMs busy).
  EXPECT_EQ(p.decode_splits, 16);
  EXPECT_EQ(p.decode_cluster, 16);
  EXPECT_EQ(p.decode_stages, 4);
  EXPECT_TRUE(p.early_kv);
  EXPECT_EQ(p.prefill_tiles, 0);
  EXPECT_EQ(gpu::paged_attention_workspace_bytes(p), 0u);

  s.max_cluster = 8;  // a device without non-portable clusters of 16: 8 splits of 256 keys
  p = gpu::plan_paged_attention(s);
  EXPECT_EQ(p.decode_splits, 8);
  EXPECT_EQ(p.decode_cluster, 8);
  s.max_cluster = gpu::kPagedAttentionMaxCluster;

  s.max_kv_len = 4096;  // still one cluster (the engine's plan for a 2048-token context): 16 splits of 256 keys
  p = gpu::plan_paged_attention(s);
  EXPECT_EQ(p.decode_splits, 16);
  EXPECT_EQ(p.decode_cluster, 16);
  EXPECT_EQ(gpu::paged_attention_workspace_bytes(p), 0u);
  s.max_kv_len = 8192;  // longer: 33 splits of 256 keys (132 CTAs: one per SM), merged through the workspace
  p = gpu::plan_paged_attention(s);
  EXPECT_EQ(p.decode_splits, 33);
  EXPECT_EQ(p.decode_cluster, 1);
  EXPECT_EQ(p.decode_stages, 2);
  EXPECT_EQ(gpu::paged_attention_workspace_bytes(p), (size_t{33} * 32 * 128 * 4 + size_t{33} * 32 * 4 + 255) / 256 * 256);
  s.max_kv_len = 2048;

  s.num_seqs = s.num_tokens = 4;
  p = gpu::plan_paged_attention(s);
  EXPECT_EQ(p.decode_splits, 9);  // 16 CTAs, 9 splits: 144, in clusters of 9
  EXPECT_EQ(p.decode_cluster, 9);
  EXPECT_EQ(p.decode_stages, 3);

  s.num_seqs = s.num_tokens = 64;
  p = gpu::plan_paged_attention(s);
  EXPECT_EQ(p.decode_splits, 1);  // 64 x 4 = 256 CTAs already fill the SMs once

  s.num_seqs = s.num_tokens = 16;
  p = gpu::plan_paged_attention(s);
  EXPECT_EQ(p.decode_splits, 3);  // 16 x 4 = 64 CTAs, 3 splits: 192 (one wave at 1-2 per SM)
  EXPECT_EQ(p.decode_cluster, 3);
  EXPECT_EQ(p.decode_stages, 3);  // 192 CTAs: three stages, two resident per SM

  s.num_seqs = s.num_tokens = 256;
  p = gpu::plan_paged_attention(s);
  EXPECT_EQ(p.decode_splits, 1);
  EXPECT_EQ(gpu::paged_attention_workspace_bytes(p), 0u);

  s.num_seqs = 1;
  s.num_tokens = 2048;
  s.max_q_len = -1;
  p = gpu::plan_paged_attention(s);
  EXPECT_EQ(p.prefill_rows, 64);
  EXPECT_EQ(p.prefill_tiles, 2048 * 8 / 64 + 1);
  EXPECT_EQ(p.prefill_splits, 1);

  s.force_cuda_cores = true;
  p = gpu::plan_paged_attention(s);
  EXPECT_FALSE(p.tensor_cores);
  EXPECT_EQ(p.prefill_rows, 16);
}

}  // namespace
}  // namespace fulcrum::test
