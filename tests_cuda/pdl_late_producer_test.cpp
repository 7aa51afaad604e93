// Dependently launched kernels read an earlier kernel's output only after their griddepcontrol.wait
// (src/gpu/kernels/dependent_launch.cuh). Each kernel under test runs right after launch_late_copy (late_copy.hpp),
// which writes the kernel's inputs about 20 us after it lets the kernel start, over inputs filled with 0xff; the
// kernel's output must be bitwise that of a run whose inputs were in place beforehand. A load scheduled ahead of
// the wait reads the fill: ptxas had put the one-token expert gate_up GEMM's __ldg of its plan there
// (docs/benchmarks.md, 9202e65). With FULCRUM_PDL=0 nothing overlaps and these tests pass trivially.
#include <cstdint>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/kernels/expert_skinny_gemm.hpp"
#include "gpu/kernels/sampler.hpp"
#include "gpu/kernels/skinny_gemm.hpp"
#include "late_copy.hpp"
#include "moe_cuda_test_util.hpp"
#include "skinny_test_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using skinny_test::download;
using skinny_test::random_bf16;
using skinny_test::upload;

constexpr uint32_t kDelayNs = 20000;  // the producer's delay: far longer than any consumer's start

class PdlLateProducerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  // `inputs` (device, `bytes`) gets `staged`'s bytes: at once (in_place), or filled with 0xff and then written by
  // the late producer just before the caller's launches on stream_. Earlier cudaMemsets of the caller's are done
  // when it returns.
  void stage(const void* staged, void* inputs, size_t bytes, bool in_place) {
    // Both finish before stream_ (non-blocking) starts: a device-to-device cudaMemcpy and cudaMemset may return early.
    ASSERT_EQ(in_place ? cudaMemcpy(inputs, staged, bytes, cudaMemcpyDeviceToDevice) : cudaMemset(inputs, 0xff, bytes),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (in_place) return;
    ASSERT_EQ(launch_late_copy(staged, inputs, bytes, kDelayNs, stream_), cudaSuccess);
  }
  cudaStream_t stream_ = nullptr;
};

TEST_F(PdlLateProducerTest, DenseSkinnyGemmReadsXOnlyAfterItsWait) {
  for (const auto& [n, k] : {std::pair{2048, 2048}, std::pair{128, 2048}}) {
    const DeviceBuffer w = upload(random_bf16(static_cast<size_t>(n) * k, 31));
    for (const int m : {1, 2, 4, 8}) {
      SCOPED_TRACE(fmt::format("m {} n {} k {}", m, n, k));
      const size_t x_bytes = sizeof(uint16_t) * m * k;
      const DeviceBuffer staged = upload(random_bf16(static_cast<size_t>(m) * k, 32 + m));
      DeviceBuffer x(x_bytes), out(sizeof(float) * m * n);
      std::vector<std::vector<float>> results;
      for (const bool in_place : {true, false}) {
        stage(staged.as<void>(), x.as<void>(), x_bytes, in_place);
        ASSERT_EQ(gpu::launch_skinny_gemm(x.as<uint16_t>(), w.as<uint16_t>(), m, n, k, out.as<float>(), nullptr, stream_),
                  cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
        results.push_back(download(out.as<float>(), static_cast<size_t>(m) * n));
      }
      EXPECT_EQ(std::memcmp(results[0].data(), results[1].data(), sizeof(float) * results[0].size()), 0);
    }
  }
}

// The MoE layer's skinny expert stage: gate_up + SwiGLU, then down (which, as in the engine, reads its plan before
// its own wait: written two kernels back). Every input the route would write, and x, come from the late producer.
TEST_F(PdlLateProducerTest, ExpertSkinnyGemmsReadPlanAndRowsOnlyAfterTheirWait) {
  const int h = 2048, inter = 768, slots = 8;
  std::vector<DeviceBuffer> gate_up, down;
  std::vector<const uint16_t*> gate_up_ptrs, down_ptrs;
  for (int s = 0; s < slots; ++s) {
    gate_up.push_back(upload(random_bf16(static_cast<size_t>(2) * inter * h, 40 + s)));
    down.push_back(upload(random_bf16(static_cast<size_t>(h) * inter, 50 + s)));
    gate_up_ptrs.push_back(gate_up.back().as<uint16_t>());
    down_ptrs.push_back(down.back().as<uint16_t>());
  }
  const DeviceBuffer d_gate_up_ptrs = upload(gate_up_ptrs), d_down_ptrs = upload(down_ptrs);
  for (const int tokens : {1, 2, 4}) {
    SCOPED_TRACE(fmt::format("{} tokens", tokens));
    // Every token in every slot: slot s holds rows [s T, (s + 1) T), row r reads token r % T.
    const int rows = slots * tokens;
    std::vector<int32_t> source(static_cast<size_t>(rows)), offsets(slots + 1), active(slots + 1);
    for (int r = 0; r < rows; ++r) source[r] = r % tokens;
    for (int s = 0; s <= slots; ++s) offsets[s] = s * tokens;
    active[0] = slots;
    for (int s = 0; s < slots; ++s) active[1 + s] = s;
    // One arena [x | source | offsets | active], each part 16-byte aligned, so one late copy writes it all.
    const auto padded = [](size_t bytes) { return (bytes + 15) / 16 * 16; };
    const size_t x_bytes = sizeof(uint16_t) * tokens * h, source_at = x_bytes;
    const size_t offsets_at = source_at + padded(sizeof(int32_t) * source.size());
    const size_t active_at = offsets_at + padded(sizeof(int32_t) * offsets.size());
    const size_t arena_bytes = active_at + padded(sizeof(int32_t) * active.size());
    std::vector<uint8_t> arena(arena_bytes, 0);
    const std::vector<uint16_t> x = random_bf16(static_cast<size_t>(tokens) * h, 60 + tokens);
    std::memcpy(arena.data(), x.data(), x_bytes);
    std::memcpy(arena.data() + source_at, source.data(), sizeof(int32_t) * source.size());
    std::memcpy(arena.data() + offsets_at, offsets.data(), sizeof(int32_t) * offsets.size());
    std::memcpy(arena.data() + active_at, active.data(), sizeof(int32_t) * active.size());
    const DeviceBuffer staged = upload(arena);
    DeviceBuffer inputs(arena_bytes), act(sizeof(uint16_t) * rows * inter), out(sizeof(uint16_t) * rows * h);
    const auto* base = inputs.as<uint8_t>();
    ExpertGemms gemms = expert_gemms(reinterpret_cast<const uint16_t*>(base),
                                     reinterpret_cast<const int32_t*>(base + source_at),
                                     reinterpret_cast<const int32_t*>(base + offsets_at),
                                     reinterpret_cast<const int32_t*>(base + active_at), d_gate_up_ptrs, d_down_ptrs, h,
                                     inter, rows, slots, act.as<uint16_t>(), out.as<uint16_t>());
    gpu::ExpertSkinnyArgs &a = gemms.gate_up, &b = gemms.down;
    a.max_slot_rows = b.max_slot_rows = tokens;
    b.plan_ready_early = true;
    std::vector<std::vector<uint16_t>> acts, outs;
    for (const bool in_place : {true, false}) {
      ASSERT_EQ(cudaMemset(act.as<void>(), 0xff, act.bytes()), cudaSuccess);
      ASSERT_EQ(cudaMemset(out.as<void>(), 0xff, out.bytes()), cudaSuccess);
      stage(staged.as<void>(), inputs.as<void>(), arena_bytes, in_place);
      ASSERT_EQ(gpu::launch_expert_skinny_gemm(a, stream_), cudaSuccess);
      ASSERT_EQ(gpu::launch_expert_skinny_gemm(b, stream_), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      acts.push_back(download(act.as<uint16_t>(), static_cast<size_t>(rows) * inter));
      outs.push_back(download(out.as<uint16_t>(), static_cast<size_t>(rows) * h));
    }
    EXPECT_EQ(acts[0], acts[1]);
    EXPECT_EQ(outs[0], outs[1]);
  }
}

TEST_F(PdlLateProducerTest, SamplerReadsLogitsOnlyAfterItsWait) {
  const int rows = 4, vocab = 151936;
  std::vector<float> logits(static_cast<size_t>(rows) * vocab);
  skinny_test::SplitMix rng{77};
  for (float& v : logits) v = 8.0f * rng.unit() - 4.0f;
  std::vector<gpu::SamplerRow> params(rows);
  for (int r = 0; r < rows; ++r) params[r] = {r % 2 == 0 ? 0.0f : 0.8f, 0.9f, r == 3 ? 50 : 0, 0, 0.125 * (r + 1)};
  const DeviceBuffer staged = upload(logits), d_params = upload(params);
  DeviceBuffer d_logits(sizeof(float) * logits.size()), tokens(sizeof(int32_t) * rows), logprobs(sizeof(float) * rows);
  const size_t ws_bytes = gpu::sampler_workspace_bytes(rows, vocab);
  DeviceBuffer ws(ws_bytes);
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> lps;
  for (const bool in_place : {true, false}) {
    stage(staged.as<void>(), d_logits.as<void>(), sizeof(float) * logits.size(), in_place);
    ASSERT_EQ(gpu::launch_sample(d_logits.as<float>(), vocab, rows, vocab, d_params.as<gpu::SamplerRow>(),
                                 tokens.as<int32_t>(), logprobs.as<float>(), ws.as<void>(), ws_bytes, stream_),
              0);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    ids.push_back(download(tokens.as<int32_t>(), rows));
    lps.push_back(download(logprobs.as<float>(), rows));
  }
  for (const int32_t id : ids[0]) EXPECT_GE(id, 0);  // the in-place run samples every row
  EXPECT_EQ(ids[0], ids[1]);
  EXPECT_EQ(std::memcmp(lps[0].data(), lps[1].data(), sizeof(float) * rows), 0);
}

}  // namespace
}  // namespace fulcrum::test
