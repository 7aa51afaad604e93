// The GPU engine with an FP8 checkpoint's dense projections kept in FP8 (GpuEngineOptions::fp8_dense_gemms,
// DeviceWeights::fp8_dense_for, DenseGemm::run_fp8), on the qwen3moe-tiny-fp8 fixture (hidden 256, q 4 x 64,
// kv 2 x 64: qkv and o in FP8; its dense layer's intermediate 320 is off the 128 grid, so that MLP stays bf16)
// and a small random FP8 config whose dense MLP is FP8 too:
// - the device holds the checkpoint's values: each FP8 view's codes x scales (scales transposed, q / k / v stacked)
//   is bitwise the checkpoint's dequantized weight (both are one fp32 multiply of the same two values), and the
//   pointer table the grouped GEMM reads holds the view's pointers;
// - the weight cache holds FP8 models: an engine loaded from the cache gives the checkpoint-loaded engine's logits
//   bit for bit (a 40-token prompt through the quantized path, a 5-token one through the skinny one), the file
//   stores e4m3 codes and fp32 scales, and a cache of the other dtype is refused with one line, both ways, as is
//   an FP8 cache with FP8 projections met by an engine that keeps them bf16 (the default);
// - fill_random fills FP8 projections (benchmarks): scales the fan-in bound / 448, codes over e4m3 without NaN;
//   decode steps of 10 sequences (the quantized path inside a captured graph) replay to the eager tokens and
//   logprobs bit for bit.
// Exact comparisons only: the same kernels on the same values give the same bits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "eplb/error.hpp"
#include "gpu/gpu_engine.hpp"
#include "model/checkpoint_writer.hpp"
#include "model/rng.hpp"
#include "model/safetensors.hpp"
#include "model_golden_util.hpp"
#include "gpu_engine_test_util.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

constexpr const char* kFixture = "qwen3moe-tiny-fp8";
constexpr int kBlock = 128;

class GpuEngineFp8Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the GPU engine tests need a GPU";
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
    if (prop.major != 9 || prop.minor != 0) GTEST_SKIP() << "the CUTLASS FP8 kernels are built for sm_90a only";
  }
};

gpu::GpuEngineOptions fp8_options() {
  gpu::GpuEngineOptions o;
  o.max_batch_tokens = 512;
  o.max_batch_seqs = 16;
  o.kv_pages = 256;
  o.fp8_dense_gemms = true;
  return o;
}

// Each prompt alone in one step (its length is the GEMMs' m): all its logits.
std::vector<std::vector<float>> prompt_logits(gpu::GpuEngine& engine, const std::vector<std::vector<int32_t>>& prompts) {
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto id = static_cast<model::SequenceId>(i);
    engine.allocate(id, static_cast<int64_t>(prompts[i].size()) + 1);
    const model::StepSequence prompt = entry(id, prompts[i], false);
    out.push_back(engine.forward_logits(std::span(&prompt, 1))[0].data);
    engine.release(id);
  }
  return out;
}

template <typename T>
std::vector<T> download(const T* device, int64_t n) {
  std::vector<T> host(static_cast<size_t>(n));
  EXPECT_EQ(cudaMemcpy(host.data(), device, sizeof(T) * host.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

uint32_t bits_of(float v) {
  uint32_t b = 0;
  std::memcpy(&b, &v, 4);
  return b;
}

TEST_F(GpuEngineFp8Test, DenseFp8WeightsHoldTheCheckpointValues) {
  const std::string dir = golden_model_dir(kFixture);
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(dir);
  const gpu::DeviceWeights::Fp8Dense fp8 = gpu::DeviceWeights::fp8_dense_for(config, true);
  EXPECT_TRUE(fp8.qkv);
  EXPECT_TRUE(fp8.o);
  EXPECT_FALSE(fp8.mlp) << "intermediate " << config.intermediate_size << " is off the 128 grid: bf16";
  gpu::GpuEngine engine(config, fp8_options());
  model::Checkpoint checkpoint(dir);
  engine.load(checkpoint);
  const int64_t h = config.hidden_size, q = int64_t{config.num_attention_heads} * config.head_dim;
  const int64_t kv = int64_t{config.num_key_value_heads} * config.head_dim;
  // Every element of the stacked parts: e4m3(code) * scale (fp32) against the checkpoint's dequantized read.
  const auto check = [&](int l, const gpu::Fp8Weight& w, const std::vector<std::pair<std::string, int64_t>>& parts,
                         int64_t cols, const char* what) {
    SCOPED_TRACE(fmt::format("layer {} {}", l, what));
    ASSERT_TRUE(w.present());
    int64_t rows = 0;
    for (const auto& part : parts) rows += part.second;
    const std::vector<uint8_t> codes = download(w.codes, rows * cols);
    const std::vector<float> scales = download(w.scales, rows / kBlock * (cols / kBlock));
    EXPECT_EQ(download(w.device_codes_ptr, 1)[0], w.codes) << "the device pointer table";
    EXPECT_EQ(download(w.device_scales_ptr, 1)[0], w.scales) << "the device pointer table";
    int64_t first_row = 0, differ = 0;
    for (const auto& [name, part_rows] : parts) {
      std::vector<float> expected(static_cast<size_t>(part_rows * cols));
      const std::vector<int64_t> shape = {part_rows, cols};
      checkpoint.read_f32_into(fmt::format("model.layers.{}.{}", l, name), shape, expected);
      for (int64_t r = 0; r < part_rows; ++r) {
        const int64_t row = first_row + r;
        for (int64_t c = 0; c < cols; ++c) {
          const float scale = scales[static_cast<size_t>((c / kBlock) * (rows / kBlock) + row / kBlock)];
          const float value = model::f8e4m3_to_f32(codes[static_cast<size_t>(row * cols + c)]) * scale;
          differ += bits_of(value) != bits_of(expected[static_cast<size_t>(r * cols + c)]);
        }
      }
      first_row += part_rows;
    }
    EXPECT_EQ(differ, 0) << "elements that differ from the checkpoint's dequantized weight";
  };
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    const gpu::LayerWeights& lw = engine.weights().layer(l);
    EXPECT_EQ(lw.qkv, nullptr);
    EXPECT_EQ(lw.o, nullptr);
    check(l, lw.qkv_fp8, {{"self_attn.q_proj.weight", q}, {"self_attn.k_proj.weight", kv}, {"self_attn.v_proj.weight", kv}}, h,
          "qkv");
    check(l, lw.o_fp8, {{"self_attn.o_proj.weight", h}}, q, "o");
    if (!config.is_moe_layer(l)) {
      EXPECT_FALSE(lw.mlp_gate_up_fp8.present());
      EXPECT_FALSE(lw.mlp_down_fp8.present());
      EXPECT_NE(lw.mlp_gate_up, nullptr);
      EXPECT_NE(lw.mlp_down, nullptr);
    }
  }
}

// --weight-cache on the FP8 fixture: the first start loads the checkpoint and writes the cache, the second loads
// the cache and gives the same logits bit for bit.
TEST_F(GpuEngineFp8Test, WeightCacheRoundTripsFp8Weights) {
  const std::string dir = golden_model_dir(kFixture);
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(dir);
  const TempDir cache("gpu_weight_cache_fp8");
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(40, config.vocab_size, 3),
                                                     random_tokens(5, config.vocab_size, 4)};
  std::vector<std::vector<float>> first, second;
  {
    gpu::GpuEngine engine(config, fp8_options());
    EXPECT_FALSE(engine.load_weights(dir, cache.path()));
    first = prompt_logits(engine, prompts);
  }
  const std::string file = gpu::DeviceWeights::cache_file(cache.path());
  ASSERT_TRUE(std::filesystem::exists(file));
  {
    const model::SafetensorsFile stored(file);
    ASSERT_NE(stored.metadata().find("weights"), stored.metadata().end());
    EXPECT_EQ(stored.metadata().at("weights").rfind("fp8", 0), 0u) << stored.metadata().at("weights");
    EXPECT_EQ(stored.info("layers.0.qkv.codes").dtype, model::Dtype::kF8E4M3);
    EXPECT_EQ(stored.info("layers.0.qkv.scales").dtype, model::Dtype::kF32);
    EXPECT_EQ(stored.info("slots.0.gate_up").dtype, model::Dtype::kF8E4M3);
    EXPECT_EQ(stored.info("slots.0.down_scales").dtype, model::Dtype::kF32);
    EXPECT_FALSE(stored.contains("model.layers.0.self_attn.q_proj.weight")) << "qkv is cached in FP8 only";
    EXPECT_EQ(stored.info("model.layers.1.mlp.gate_proj.weight").dtype, model::Dtype::kBF16) << "the bf16 dense MLP";
  }
  {
    gpu::GpuEngine engine(config, fp8_options());
    EXPECT_TRUE(engine.load_weights(dir, cache.path()));
    second = prompt_logits(engine, prompts);
  }
  ASSERT_EQ(first.size(), second.size());
  for (size_t i = 0; i < first.size(); ++i) {
    ASSERT_EQ(first[i].size(), second[i].size());
    EXPECT_EQ(std::memcmp(first[i].data(), second[i].data(), 4 * first[i].size()), 0) << "prompt " << i;
  }
}

// A bf16 cache met by the FP8 model, and an FP8 cache met by the same shapes in bf16: one line naming the dtypes.
TEST_F(GpuEngineFp8Test, WeightCacheOfTheOtherDtypeIsRefused) {
  const std::string dir = golden_model_dir(kFixture);
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(dir);
  model::Qwen3MoeConfig bf16_config = config;
  bf16_config.quantization.reset();
  const TempDir bf16_cache("gpu_weight_cache_bf16"), fp8_cache("gpu_weight_cache_fp8");
  {
    gpu::GpuEngine engine(bf16_config, fp8_options());
    engine.fill_random(3);
    engine.weights().save_cache(bf16_cache.path());
  }
  {
    gpu::GpuEngine engine(config, fp8_options());
    EXPECT_FALSE(engine.load_weights(dir, fp8_cache.path()));  // writes the FP8 cache
  }
  const auto expect_refused = [&](const model::Qwen3MoeConfig& c, const std::string& cache_dir, const std::string& holds) {
    gpu::GpuEngine engine(c, fp8_options());
    try {
      engine.load_weights(dir, cache_dir);
      ADD_FAILURE() << "a cache holding " << holds << " weights was loaded";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("weight cache holds " + holds), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  };
  expect_refused(config, bf16_cache.path(), "bf16");
  expect_refused(bf16_config, fp8_cache.path(), "fp8");
  gpu::GpuEngineOptions bf16_dense = fp8_options();
  bf16_dense.fp8_dense_gemms = false;
  gpu::GpuEngine engine(config, bf16_dense);
  EXPECT_FALSE(engine.weights().fp8_dense().any());
  try {
    engine.load_weights(dir, fp8_cache.path());
    ADD_FAILURE() << "a cache with FP8 projections was loaded by an engine holding them in bf16";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("qkv o"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
}

// A small FP8 config whose every dense projection is FP8 (q 8 x 64, kv 2 x 64, intermediate 384).
model::Qwen3MoeConfig small_fp8_config() {
  model::Qwen3MoeConfig c = small_config();
  c.quantization = model::Fp8BlockQuantization{};
  return c;
}

TEST_F(GpuEngineFp8Test, FillRandomFillsFp8Projections) {
  const model::Qwen3MoeConfig config = small_fp8_config();
  const gpu::DeviceWeights::Fp8Dense fp8 = gpu::DeviceWeights::fp8_dense_for(config, true);
  ASSERT_TRUE(fp8.qkv && fp8.o && fp8.mlp);
  gpu::GpuEngine engine(config, fp8_options());
  engine.fill_random(9);
  const gpu::LayerWeights& dense = engine.weights().layer(1);
  ASSERT_EQ(dense.moe_layer_idx, -1);
  EXPECT_EQ(dense.mlp_gate_up, nullptr);
  const auto check = [&](const gpu::Fp8Weight& w, int64_t rows, int64_t cols, const char* what) {
    SCOPED_TRACE(what);
    ASSERT_TRUE(w.present());
    const float expected = 1.0f / std::sqrt(static_cast<float>(cols)) / 448.0f;  // DeviceWeights: fan-in bound / 448
    const std::vector<float> scales = download(w.scales, rows / kBlock * (cols / kBlock));
    EXPECT_TRUE(std::all_of(scales.begin(), scales.end(), [&](float s) { return bits_of(s) == bits_of(expected); }));
    const std::vector<uint8_t> codes = download(w.codes, rows * cols);
    EXPECT_TRUE(std::none_of(codes.begin(), codes.end(), [](uint8_t c) { return (c & 0x7f) == 0x7f; })) << "NaN codes";
    // Uniform values in [-448, 448] hit every code of magnitude >= 0.5 (159 codes) many times at these sizes.
    EXPECT_GE(std::set<uint8_t>(codes.begin(), codes.end()).size(), 100u) << "codes spread over e4m3";
  };
  check(engine.weights().layer(0).qkv_fp8, 768, 256, "qkv");
  check(engine.weights().layer(2).o_fp8, 256, 512, "o");
  check(dense.mlp_gate_up_fp8, 768, 256, "gate_up");
  check(dense.mlp_down_fp8, 256, 384, "down");
  for (const auto& logits : prompt_logits(engine, {random_tokens(20, config.vocab_size, 1), random_tokens(3, config.vocab_size, 2)})) {
    EXPECT_TRUE(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));
  }
}

// Greedy decoding of 10 sequences (m = 10: the quantized FP8 path) eager and through graphs: the same tokens and
// logprob bits.
std::vector<std::pair<int32_t, float>> decode_fp8(bool graphs, int steps, gpu::GpuEngine::Counters* counters) {
  gpu::GpuEngineOptions options = fp8_options();
  options.cuda_graphs = graphs;
  gpu::GpuEngine engine(small_fp8_config(), options);
  engine.fill_random(5);
  return greedy_decode(engine, /*batch=*/10, /*prompt_step=*/7, steps, counters);
}

TEST_F(GpuEngineFp8Test, Fp8DecodeGraphsReplayToEagerBits) {
  gpu::GpuEngine::Counters c;
  const auto eager = decode_fp8(false, 6, nullptr);
  const auto graphs = decode_fp8(true, 6, &c);
  ASSERT_EQ(eager.size(), graphs.size());
  for (size_t i = 0; i < eager.size(); ++i) {
    EXPECT_EQ(eager[i].first, graphs[i].first) << i;
    EXPECT_EQ(bits_of(eager[i].second), bits_of(graphs[i].second)) << i << ": " << eager[i].second << " vs " << graphs[i].second;
  }
  EXPECT_GE(c.graph_replays, 4) << "the decode steps should replay graphs";
}

}  // namespace
}  // namespace fulcrum::test
