// Decode attention timings at the Qwen3-30B-A3B attention shape (32 q heads, 4 kv heads, head_dim 128, page 16):
// the engine's kernel (kernels/paged_attention.hpp, its decode plan as the engine makes it) beside FlashInfer's
// tensor-core decode (flashinfer/flashinfer_attention.hpp), batch 1 / 4 / 16 / 64 at contexts 512 and 2048. Each
// figure is the median over 11 samples of 48 back-to-back launches (a model's layers) divided by 48, each launch
// on its own copy of the pools (enough copies to exceed the 50 MB L2, as the layers of a step do); the roofline
// is the KV bytes over the device-to-device copy bandwidth measured here. Correctness of both kernels is tested
// elsewhere (gpu_paged_attention_test.cpp, gpu_flashinfer_attention_test.cpp); this test only measures and prints.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/flashinfer/flashinfer_attention.hpp"
#include "gpu/kernels/attention_batch.hpp"
#include "gpu/kernels/paged_attention.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "gpu/moe/moe_layer.hpp"  // backend::DeviceBuffer

namespace fulcrum::test {
namespace {

constexpr int kHeads = 32, kKvHeads = 4, kHeadDim = 128, kPageSize = 16;
constexpr int kLayers = 48;  // launches per sample
constexpr int kSamples = 11;
constexpr size_t kMinPoolBytes = size_t{192} << 20;  // all copies together: several times the L2

using backend::DeviceBuffer;

template <typename T>
DeviceBuffer upload(const std::vector<T>& src) {
  DeviceBuffer dst(sizeof(T) * src.size());
  EXPECT_EQ(cudaMemcpy(dst.as<void>(), src.data(), sizeof(T) * src.size(), cudaMemcpyHostToDevice), cudaSuccess);
  return dst;
}

// Device-to-device copy bandwidth (bytes read + written per second) over a 1 GiB copy, median of 5.
double copy_bandwidth(cudaStream_t stream) {
  constexpr size_t kBytes = size_t{1} << 30;
  DeviceBuffer a(kBytes), b(kBytes);
  cudaEvent_t start = nullptr, stop = nullptr;
  EXPECT_EQ(cudaEventCreate(&start), cudaSuccess);
  EXPECT_EQ(cudaEventCreate(&stop), cudaSuccess);
  std::vector<double> rates;
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(cudaEventRecord(start, stream), cudaSuccess);
    EXPECT_EQ(cudaMemcpyAsync(b.as<void>(), a.as<void>(), kBytes, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
    EXPECT_EQ(cudaEventRecord(stop, stream), cudaSuccess);
    EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
    float ms = 0;
    EXPECT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
    if (i > 0) rates.push_back(2.0 * kBytes / (1e-3 * ms));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::nth_element(rates.begin(), rates.begin() + rates.size() / 2, rates.end());
  return rates[rates.size() / 2];
}

// Median over kSamples of the time of kLayers calls of run(layer), per call, in microseconds.
template <typename Run>
double per_launch_us(cudaStream_t stream, Run run) {
  for (int l = 0; l < kLayers; ++l) run(l);  // warm-up
  cudaEvent_t start = nullptr, stop = nullptr;
  EXPECT_EQ(cudaEventCreate(&start), cudaSuccess);
  EXPECT_EQ(cudaEventCreate(&stop), cudaSuccess);
  std::vector<double> us;
  for (int s = 0; s < kSamples; ++s) {
    EXPECT_EQ(cudaEventRecord(start, stream), cudaSuccess);
    for (int l = 0; l < kLayers; ++l) run(l);
    EXPECT_EQ(cudaEventRecord(stop, stream), cudaSuccess);
    EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
    float ms = 0;
    EXPECT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
    us.push_back(1e3 * ms / kLayers);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::nth_element(us.begin(), us.begin() + kSamples / 2, us.end());
  return us[kSamples / 2];
}

TEST(AttentionDecodeTimings, PrintsTimings) {
  if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const double bandwidth = copy_bandwidth(stream);
  std::printf("device copy bandwidth %.0f GB/s; 30B-A3B attention: %d q heads, %d kv heads, head_dim %d, page %d\n",
              bandwidth / 1e9, kHeads, kKvHeads, kHeadDim, kPageSize);
  std::printf("%5s %7s %7s %7s %7s %10s %13s %10s %12s\n", "batch", "context", "planned", "splits", "cluster",
              "fulcrum us", "flashinfer us", "roofline", "fulcrum/fi");
  const bool flashinfer = gpu::FlashInferAttention::supports(kHeadDim, kHeads, kKvHeads);
  // planned: the max_kv_len the plan is made for; the engine's decode graphs plan for the power of two at or above
  // the longest sequence (AttentionRunner::decode_bucket), so a 2048-token context runs on a plan for 4096.
  struct Case {
    int context, planned;
    std::vector<int> batches;
  };
  const std::vector<Case> cases{{512, 512, {1, 4, 16, 64}}, {2048, 2048, {1, 4, 16, 64}}, {2048, 4096, {1, 4, 16}},
                                {4096, 4096, {1, 4, 16}}, {8192, 8192, {1, 4}}, {16384, 16384, {1}}};
  for (const Case& c : cases) {
    const int context = c.context;
    for (const int batch : c.batches) {
      const int pages_per_seq = (context + kPageSize - 1) / kPageSize;
      const int num_pages = batch * pages_per_seq;
      const size_t row_elems = size_t{kKvHeads} * kHeadDim;
      const size_t pool_elems = static_cast<size_t>(num_pages) * kPageSize * row_elems;
      const int copies = static_cast<int>(std::clamp<size_t>(kMinPoolBytes / (4 * pool_elems) + 1, 2, kLayers));
      DeviceBuffer k(sizeof(uint16_t) * pool_elems * copies), v(sizeof(uint16_t) * pool_elems * copies);
      ASSERT_EQ(cuda::moe::launch_fill_random_bf16(k.as<uint16_t>(), static_cast<int64_t>(pool_elems) * copies, 1, 1.0f, stream),
                cudaSuccess);
      ASSERT_EQ(cuda::moe::launch_fill_random_bf16(v.as<uint16_t>(), static_cast<int64_t>(pool_elems) * copies, 2, 1.0f, stream),
                cudaSuccess);
      const size_t q_elems = static_cast<size_t>(batch) * kHeads * kHeadDim;
      DeviceBuffer q(sizeof(uint16_t) * q_elems), out(sizeof(uint16_t) * q_elems);
      ASSERT_EQ(cuda::moe::launch_fill_random_bf16(q.as<uint16_t>(), static_cast<int64_t>(q_elems), 3, 1.0f, stream),
                cudaSuccess);
      std::vector<int32_t> q_indptr(batch + 1), kv_page_indptr(batch + 1), kv_len(batch, context), page_ids(num_pages);
      std::iota(q_indptr.begin(), q_indptr.end(), 0);
      for (int s = 0; s <= batch; ++s) kv_page_indptr[s] = s * pages_per_seq;
      std::iota(page_ids.begin(), page_ids.end(), 0);
      std::shuffle(page_ids.begin(), page_ids.end(), std::mt19937(7));  // scattered pages, as a pool's free list
      const DeviceBuffer q_indptr_d = upload(q_indptr), kv_page_indptr_d = upload(kv_page_indptr),
                         kv_len_d = upload(kv_len), page_ids_d = upload(page_ids);
      DeviceBuffer counters(sizeof(int32_t) * batch * kKvHeads);
      ASSERT_EQ(cudaMemset(counters.as<void>(), 0, sizeof(int32_t) * batch * kKvHeads), cudaSuccess);

      gpu::AttentionBatch view;
      view.q = q.as<uint16_t>();
      view.out = out.as<uint16_t>();
      view.q_indptr = q_indptr_d.as<int32_t>();
      view.kv_page_indptr = kv_page_indptr_d.as<int32_t>();
      view.page_ids = page_ids_d.as<int32_t>();
      view.kv_len = kv_len_d.as<int32_t>();
      view.split_counters = counters.as<int32_t>();
      view.num_seqs = batch;
      view.num_tokens = batch;
      view.num_heads = kHeads;
      view.num_kv_heads = kKvHeads;
      view.head_dim = kHeadDim;
      view.page_size = kPageSize;
      view.sm_scale = 0.08838834764831845f;
      const auto at_layer = [&](int layer) {
        gpu::AttentionBatch b = view;
        b.k_pool = k.as<uint16_t>() + static_cast<size_t>(layer % copies) * pool_elems;
        b.v_pool = v.as<uint16_t>() + static_cast<size_t>(layer % copies) * pool_elems;
        return b;
      };

      gpu::PagedAttentionShape shape;
      shape.num_seqs = batch;
      shape.num_tokens = batch;
      shape.num_heads = kHeads;
      shape.num_kv_heads = kKvHeads;
      shape.head_dim = kHeadDim;
      shape.max_kv_len = c.planned;
      shape.max_q_len = 1;
      shape.num_sms = sms;
      shape.max_cluster = gpu::paged_attention_max_cluster();
      const gpu::PagedAttentionPlan plan = gpu::plan_paged_attention(shape);
      DeviceBuffer workspace(gpu::paged_attention_workspace_bytes(plan));
      const size_t workspace_bytes = gpu::paged_attention_workspace_bytes(plan);
      const double ours = per_launch_us(stream, [&](int layer) {
        EXPECT_EQ(gpu::launch_paged_attention(at_layer(layer), plan, workspace.as<void>(), workspace_bytes, stream), cudaSuccess);
      });
      double theirs = 0;
      if (flashinfer) {
        gpu::FlashInferAttention fi(kHeads, kKvHeads, kHeadDim, kPageSize, batch, batch);
        fi.plan(q_indptr, kv_page_indptr, kv_len, /*for_cuda_graph=*/false, stream);
        theirs = per_launch_us(stream, [&](int layer) { fi.run(at_layer(layer), stream); });
      }
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const double kv_bytes = 2.0 * sizeof(uint16_t) * static_cast<double>(batch) * context * row_elems;
      const double roofline_us = 1e6 * kv_bytes / bandwidth;
      std::printf("%5d %7d %7d %7d %7d %10.2f %13.2f %9.2f %12.2f\n", batch, context, c.planned, plan.decode_splits,
                  plan.decode_cluster, ours, theirs, roofline_us, theirs > 0 ? ours / theirs : 0.0);
    }
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace fulcrum::test
