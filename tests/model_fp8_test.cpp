// FP8 block-quantized checkpoints (the Qwen3-*-FP8 layout): the float8_e4m3fn decode, the
// quantization_config, dequantization on read (whole tensors and tensor-parallel blocks that cut a 128
// block), every corrupt input as a one-line error, and the fp8 golden fixture through TP 2 ranks.
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine_test_util.hpp"
#include "model/checkpoint_writer.hpp"
#include "model/make_model.hpp"
#include "model/qwen3_config.hpp"
#include "model/synthetic_model.hpp"
#include "model/safetensors.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

using model::Dtype;
using nlohmann::json;

constexpr const char* kFp8 = "qwen3moe-tiny-fp8";  // 3 layers (1 dense), 32 experts, hidden 256, moe 192

struct RawTensor {
  std::string dtype;  // safetensors dtype string
  std::vector<int64_t> shape;
  std::string bytes;
};

void write_raw_safetensors(const std::string& path, const std::map<std::string, RawTensor>& tensors) {
  json header = json::object();
  std::string data;
  for (const auto& [name, t] : tensors) {
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  const std::string text = header.dump();
  std::string bytes(8, '\0');
  const uint64_t size = text.size();
  std::memcpy(bytes.data(), &size, 8);
  std::ofstream(path, std::ios::binary) << bytes << text << data;
}

std::string f32_bytes(const std::vector<float>& values) {
  return {reinterpret_cast<const char*>(values.data()), values.size() * 4};
}

std::string bf16_bytes(const std::vector<float>& values) {
  std::string bytes;
  for (const float v : values) {
    uint32_t bits = 0;
    std::memcpy(&bits, &v, 4);
    const uint16_t high = static_cast<uint16_t>(bits >> 16);  // the values used here are exact in bf16
    bytes.append(reinterpret_cast<const char*>(&high), 2);
  }
  return bytes;
}

// fp8 bits of element i: every finite code, both signs, never NaN (0x7f / 0xff).
uint8_t fp8_code(int64_t i) {
  const auto code = static_cast<uint8_t>((i * 37 + 11) % 0x7f);  // 0x00..0x7e
  return static_cast<uint8_t>(code | (i % 3 == 0 ? 0x80 : 0x00));
}

json quantization_json() {
  return {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"}, {"weight_block_size", {128, 128}}};
}

// A checkpoint folder of one FP8 weight "w.weight" [200, 130] (2 x 2 blocks, partial at both edges) and
// its scales, plus a bf16 "norm.weight"; `edit` changes tensors or config before writing.
struct Fp8Folder {
  std::map<std::string, RawTensor> tensors;
  json config = {{"quantization_config", quantization_json()}};
  std::vector<float> scales = {0.5f, 2.0f, 0.25f, 4.0f};

  Fp8Folder() {
    std::string w(200 * 130, '\0');
    for (int64_t i = 0; i < 200 * 130; ++i) w[static_cast<size_t>(i)] = static_cast<char>(fp8_code(i));
    tensors["w.weight"] = {"F8_E4M3", {200, 130}, w};
    tensors["w.weight_scale_inv"] = {"F32", {2, 2}, f32_bytes(scales)};
    tensors["norm.weight"] = {"BF16", {2}, bf16_bytes({1.0f, 2.0f})};
  }

  void write(const TempDir& dir, bool with_config = true) const {
    std::filesystem::remove(dir.file("config.json"));
    if (with_config) std::ofstream(dir.file("config.json")) << config.dump();
    write_raw_safetensors(dir.file("model.safetensors"), tensors);
  }
};

void expect_one_line_error(const std::function<void()>& f, const std::string& expected) {
  const std::string message = error_of(f);
  EXPECT_NE(message.find(expected), std::string::npos) << "expected '" << expected << "' in: " << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST(ModelFp8, E4m3DecodesEveryCodeExactly) {
  EXPECT_EQ(model::f8e4m3_to_f32(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(model::f8e4m3_to_f32(0x80)));
  EXPECT_EQ(model::f8e4m3_to_f32(0x01), 0x1p-9f);      // smallest subnormal
  EXPECT_EQ(model::f8e4m3_to_f32(0x07), 7 * 0x1p-9f);  // largest subnormal
  EXPECT_EQ(model::f8e4m3_to_f32(0x08), 0x1p-6f);      // smallest normal
  EXPECT_EQ(model::f8e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(model::f8e4m3_to_f32(0x3c), 1.5f);
  EXPECT_EQ(model::f8e4m3_to_f32(0xc0), -2.0f);
  EXPECT_EQ(model::f8e4m3_to_f32(0x78), 256.0f);  // exponent 15 is finite in e4m3fn
  EXPECT_EQ(model::f8e4m3_to_f32(0x7e), 448.0f);  // largest finite
  EXPECT_EQ(model::f8e4m3_to_f32(0xfe), -448.0f);
  EXPECT_TRUE(std::isnan(model::f8e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(model::f8e4m3_to_f32(0xff)));
  // Every code below 0x7f: finite, strictly increasing, negated by the sign bit, and each one the value
  // (8 + m) * 2^(e - 10) (normal) or m * 2^-9 (subnormal).
  for (int code = 0; code < 0x7f; ++code) {
    const float v = model::f8e4m3_to_f32(static_cast<uint8_t>(code));
    const int e = code >> 3, m = code & 7;
    EXPECT_EQ(v, e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10)) << code;
    EXPECT_EQ(model::f8e4m3_to_f32(static_cast<uint8_t>(code | 0x80)), -v) << code;
    if (code > 0) EXPECT_GT(v, model::f8e4m3_to_f32(static_cast<uint8_t>(code - 1))) << code;
  }
}

TEST(ModelFp8, QuantizationConfigParsesInBothConventions) {
  json config = json::parse(slurp(golden_model_dir(kFp8) + "/config.json"));
  const model::Qwen3MoeConfig local = model::parse_qwen3_moe_config(config, "fp8");
  ASSERT_TRUE(local.quantization.has_value());
  EXPECT_EQ(local.quantization->block_rows, 128);
  EXPECT_EQ(local.quantization->block_cols, 128);
  // The hub convention (num_experts, rope_theta) with the same quantization_config.
  json hub = config;
  hub["num_experts"] = hub["num_local_experts"];
  hub.erase("num_local_experts");
  hub["rope_theta"] = hub["rope_parameters"]["rope_theta"];
  hub.erase("rope_parameters");
  EXPECT_TRUE(model::parse_qwen3_moe_config(hub, "hub").quantization.has_value());
  // Absent or null: not quantized.
  json plain = config;
  plain["quantization_config"] = nullptr;
  EXPECT_FALSE(model::parse_qwen3_moe_config(plain, "plain").quantization.has_value());
  plain.erase("quantization_config");
  EXPECT_FALSE(model::parse_qwen3_moe_config(plain, "plain").quantization.has_value());
}

TEST(ModelFp8, QuantizationConfigRejectsOtherForms) {
  const json config = json::parse(slurp(golden_model_dir(kFp8) + "/config.json"));
  const std::vector<std::pair<std::function<void(json&)>, std::string>> cases = {
      {[](json& q) { q["quant_method"] = "gptq"; }, "key 'quantization_config.quant_method': unsupported value \"gptq\""},
      {[](json& q) { q["fmt"] = "e5m2"; }, "key 'quantization_config.fmt': unsupported value \"e5m2\""},
      {[](json& q) { q["activation_scheme"] = "static"; }, "key 'quantization_config.activation_scheme'"},
      {[](json& q) { q.erase("fmt"); }, "missing key 'quantization_config.fmt'"},
      {[](json& q) { q["weight_block_size"] = {128, 64}; }, "unsupported block size [128,64] (only [128, 128])"},
      {[](json& q) { q["weight_block_size"] = {64, 64}; }, "key 'quantization_config.weight_block_size'"},
      {[](json& q) { q["weight_block_size"] = 128; }, "key 'quantization_config.weight_block_size'"},
      {[](json& q) { q.erase("weight_block_size"); }, "missing key 'quantization_config.weight_block_size'"},
      {[](json& q) { q = "fp8"; }, "key 'quantization_config' must be an object"},
  };
  for (const auto& [edit, expected] : cases) {
    json bad = config;
    edit(bad["quantization_config"]);
    expect_one_line_error([&] { model::parse_qwen3_moe_config(bad, "cfg.json"); }, expected);
    expect_one_line_error([&] { model::parse_qwen3_moe_config(bad, "cfg.json"); }, "cfg.json: ");
  }
}

TEST(ModelFp8, ReadsDequantizePerBlockWithAbsoluteIndices) {
  TempDir dir("fp8");
  for (const char* scale_dtype : {"F32", "BF16"}) {
    Fp8Folder folder;
    if (std::string(scale_dtype) == "BF16") folder.tensors["w.weight_scale_inv"] = {"BF16", {2, 2}, bf16_bytes(folder.scales)};
    folder.write(dir);
    model::Checkpoint checkpoint(dir.path());
    ASSERT_TRUE(checkpoint.quantization().has_value());
    const std::vector<int64_t> shape = {200, 130};
    std::vector<float> full(200 * 130);
    checkpoint.read_f32_into("w.weight", shape, full);
    for (int64_t r = 0; r < 200; ++r) {
      for (int64_t c = 0; c < 130; ++c) {
        const float expected = model::f8e4m3_to_f32(fp8_code(r * 130 + c)) * folder.scales[(r / 128) * 2 + c / 128];
        ASSERT_EQ(full[r * 130 + c], expected) << scale_dtype << " r " << r << " c " << c;
      }
    }
    // A block cutting both 128 boundaries (what a TP shard reads) equals the slice of the full tensor.
    std::vector<float> block(50 * 9);
    checkpoint.read_f32_block_into("w.weight", shape, 100, 50, 121, 9, block);  // rows [100, 150) x cols [121, 130)
    for (int r = 0; r < 50; ++r) {
      for (int c = 0; c < 9; ++c) EXPECT_EQ(block[r * 9 + c], full[(100 + r) * 130 + 121 + c]);
    }
    // The bf16 tensor reads as before.
    std::vector<float> norm(2);
    checkpoint.read_f32_into("norm.weight", std::vector<int64_t>{2}, norm);
    EXPECT_EQ(norm, (std::vector<float>{1.0f, 2.0f}));
  }
}

TEST(ModelFp8, CorruptCheckpointsAreOneLineErrors) {
  TempDir dir("fp8");
  const std::vector<int64_t> shape = {200, 130};
  std::vector<float> out(200 * 130);
  const auto open_error = [&](const Fp8Folder& folder, const std::string& expected, bool with_config = true) {
    folder.write(dir, with_config);
    expect_one_line_error([&] { model::Checkpoint c(dir.path()); }, expected);
  };
  const auto read_error = [&](const Fp8Folder& folder, const std::string& expected) {
    folder.write(dir);
    model::Checkpoint checkpoint(dir.path());
    expect_one_line_error([&] { checkpoint.read_f32_into("w.weight", shape, out); }, expected);
    std::vector<float> block(4);
    expect_one_line_error([&] { checkpoint.read_f32_block_into("w.weight", shape, 0, 2, 0, 2, block); }, expected);
  };
  {  // a scale of the wrong shape
    Fp8Folder f;
    f.tensors["w.weight_scale_inv"] = {"F32", {1, 4}, f32_bytes(f.scales)};
    open_error(f, "scale tensor 'w.weight_scale_inv' has shape [1, 4], expected [2, 2]");
  }
  {  // a missing scale
    Fp8Folder f;
    f.tensors.erase("w.weight_scale_inv");
    open_error(f, "F8_E4M3 tensor 'w.weight' has no scale tensor 'w.weight_scale_inv'");
  }
  for (const char* dtype : {"F16", "I32"}) {  // a scale of another dtype
    Fp8Folder f;
    f.tensors["w.weight_scale_inv"].dtype = dtype;
    f.tensors["w.weight_scale_inv"].bytes.resize(std::string(dtype) == "F16" ? 8 : 16);
    open_error(f, fmt::format("has dtype {}, expected F32 or BF16", dtype));
  }
  {  // an FP8 weight without quantization_config, or without config.json
    Fp8Folder f;
    f.config = json::object();
    open_error(f, "tensor 'w.weight' is F8_E4M3 but");
    open_error(f, "has no quantization_config", false);
  }
  {  // a quantization_config with another block size
    Fp8Folder f;
    f.config["quantization_config"]["weight_block_size"] = {128, 256};
    open_error(f, "config.json: key 'quantization_config.weight_block_size': unsupported block size [128,256]");
  }
  {  // a scale whose weight is not FP8 (a quantization_config over bf16 weights)
    Fp8Folder f;
    f.tensors["norm.weight_scale_inv"] = {"F32", {1, 1}, f32_bytes({1.0f})};
    open_error(f, "scale tensor 'norm.weight_scale_inv' belongs to no F8_E4M3 tensor ('norm.weight' is BF16)");
    f.tensors.erase("norm.weight_scale_inv");
    f.tensors["x.weight_scale_inv"] = {"F32", {1, 1}, f32_bytes({1.0f})};
    open_error(f, "('x.weight' is missing)");
  }
  const float kNan = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  for (const float bad : {kNan, kInf, -kInf, 0.0f, -0.0f, -1.0f}) {  // NaN, infinite, zero, negative scales
    Fp8Folder f;
    f.scales[3] = bad;
    f.tensors["w.weight_scale_inv"].bytes = f32_bytes(f.scales);
    read_error(f, "at block 3 (scales must be finite and positive)");
  }
}

// A one-layer dense config and a checkpoint whose config.json says FP8 but whose q_proj is bf16.
TEST(ModelFp8, QuantizedConfigNeedsFp8LinearWeights) {
  TempDir dir("fp8");
  json config = json::parse(slurp(golden_model_dir(kFp8) + "/config.json"));
  model::Qwen3MoeConfig quantized = model::parse_qwen3_moe_config(config, "fp8");
  Fp8Folder folder;
  folder.tensors.clear();
  folder.tensors["model.layers.0.self_attn.q_proj.weight"] = {"BF16", {1, 2}, bf16_bytes({1.0f, 2.0f})};
  folder.write(dir);
  model::Checkpoint checkpoint(dir.path());
  expect_one_line_error([&] { model::checked_fp8_scale_names(quantized, checkpoint); },
                        "tensor 'model.layers.0.self_attn.q_proj.weight' has dtype BF16, but config.json's "
                        "quantization_config makes every linear weight F8_E4M3");
  model::Qwen3MoeConfig plain = quantized;
  plain.quantization.reset();
  expect_one_line_error([&] { model::checked_fp8_scale_names(plain, checkpoint); },
                        "the model config is not quantized but the checkpoint's config.json is FP8-quantized");
}

TEST(ModelFp8, FixtureScalesAreExactlyTheExpectedNames) {
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(golden_model_dir(kFp8));
  model::Checkpoint checkpoint(golden_model_dir(kFp8));
  const std::set<std::string> scales = model::checked_fp8_scale_names(config, checkpoint);
  // 3 layers x 4 attention projections + 2 MoE layers x 32 experts x 3 + 1 dense layer x 3.
  EXPECT_EQ(scales.size(), 12u + 192u + 3u);
  size_t num_scales_in_checkpoint = 0;
  for (const std::string& name : checkpoint.names()) num_scales_in_checkpoint += scales.count(name);
  EXPECT_EQ(num_scales_in_checkpoint, scales.size());
  EXPECT_EQ(checkpoint.info("model.layers.0.self_attn.q_proj.weight").dtype, model::Dtype::kF8E4M3);
  EXPECT_EQ(checkpoint.info("model.layers.0.mlp.gate.weight").dtype, model::Dtype::kBF16);  // the router stays bf16
  // An unquantized fixture accepts no scale tensors.
  const model::Qwen3MoeConfig mix = model::load_qwen3_moe_config(golden_model_dir(kDenseMix));
  model::Checkpoint mix_checkpoint(golden_model_dir(kDenseMix));
  EXPECT_TRUE(model::checked_fp8_scale_names(mix, mix_checkpoint).empty());
}

// TP 2 cuts 128 blocks (dense intermediate 320 -> 160 per rank, moe_intermediate 192 -> 96): each rank
// dequantizes its shard with the scales of its absolute rows/columns; logits match one rank.
TEST(ModelFp8, TensorParallelShardsCutBlocksAndMatchOneRank) {
  engine::ParallelFlags flags;
  flags.tp = 2;
  const float diff = max_logit_diff(run_engine(kFp8, flags, {}), fixture(kFp8).reference);
  std::cout << "[ fp8 ] TP 2 vs one rank: max |logits diff| = " << diff << "\n";
  EXPECT_LE(diff, 1e-4f);
}

// fp32 -> e4m3 encoding: every code round-trips, midpoints round to the even code, large values saturate.
TEST(ModelFp8, E4m3EncodingRoundsToNearestEven) {
  for (int code = 0; code < 0x7f; ++code) {
    for (const int sign : {0, 0x80}) {
      const auto bits = static_cast<uint8_t>(code | sign);
      if (code == 0 && sign) continue;  // -0 encodes as 0x80, checked below
      EXPECT_EQ(model::f32_to_f8e4m3_bits(model::f8e4m3_to_f32(bits)), bits) << code;
    }
    if (code + 1 < 0x7f) {  // the midpoint between two neighbours goes to the one with an even code
      const float lo = model::f8e4m3_to_f32(static_cast<uint8_t>(code));
      const float hi = model::f8e4m3_to_f32(static_cast<uint8_t>(code + 1));
      EXPECT_EQ(model::f32_to_f8e4m3_bits((lo + hi) / 2), code % 2 == 0 ? code : code + 1) << code;
    }
  }
  EXPECT_EQ(model::f32_to_f8e4m3_bits(-0.0f), 0x80);
  EXPECT_EQ(model::f32_to_f8e4m3_bits(1e6f), 0x7e);
  EXPECT_EQ(model::f32_to_f8e4m3_bits(-460.0f), 0xfe);
  EXPECT_EQ(model::f32_to_f8e4m3_bits(1e-9f), 0x00);
  EXPECT_EQ(model::f32_to_f8e4m3_bits(std::numeric_limits<float>::quiet_NaN()), 0x7f);
}

// |dequantized - original| within half an fp8 step: 2^-4 of |w| (normal range), or 2^-10 of the block's
// scale (subnormal range), plus fp32 rounding of the division and the product.
void expect_within_fp8_rounding(float dequantized, float original, float scale, const std::string& where) {
  const float bound = std::max(std::abs(original) * 0x1p-4f, scale * 0x1p-10f) * (1 + 1e-5f);
  ASSERT_LE(std::abs(dequantized - original), bound) << where << ": " << original << " -> " << dequantized;
}

TEST(ModelFp8, QuantizeBlocksWithPartialAndZeroBlocks) {
  const int64_t rows = 200, cols = 130;
  std::vector<float> weight(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) weight[i] = std::sin(0.37f * static_cast<float>(i)) * (1 + static_cast<float>(i % 7));
  for (int64_t r = 128; r < rows; ++r) {
    for (int64_t c = 128; c < cols; ++c) weight[r * cols + c] = 0;  // the last partial block is all zero
  }
  std::vector<float> fp8(weight.size()), scales(4);
  model::quantize_fp8_blocks(weight, rows, cols, model::Fp8BlockQuantization{}, fp8, scales);
  EXPECT_EQ(scales[3], 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = scales[(r / 128) * 2 + c / 128];
      const float value = fp8[r * cols + c];
      ASSERT_LE(std::abs(value), 448.0f);
      ASSERT_EQ(model::f8e4m3_to_f32(model::f32_to_f8e4m3_bits(value)), value);  // exactly an fp8 value
      expect_within_fp8_rounding(value * scale, weight[r * cols + c], scale, fmt::format("[{}, {}]", r, c));
    }
  }
  // Each block's largest |w| maps to +-448.
  for (int b = 0; b < 3; ++b) EXPECT_GT(scales[b], 0.0f);
}

// make-model --dtype fp8: the Qwen3-*-FP8 layout; it loads, and every dequantized weight is within fp8
// rounding of the random bf16-free original (the same seed's SyntheticWeights).
// make-model's options for a tiny FP8 checkpoint of `layers` layers in tmp/m.
model::MakeModelOptions tiny_fp8_options(const TempDir& tmp, int layers) {
  model::MakeModelOptions options;
  options.preset = "tiny";
  options.output = tmp.file("m");
  options.layers = layers;
  options.dtype = model::parse_make_model_dtype("fp8");
  return options;
}

TEST(ModelFp8, MakeModelWritesLoadableFp8Checkpoints) {
  TempDir tmp("fp8_make");
  model::MakeModelOptions options = tiny_fp8_options(tmp, 2);
  options.seed = 5;
  const model::MakeModelResult result = model::make_model(options);
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(options.output);
  ASSERT_TRUE(config.quantization.has_value());
  model::Checkpoint checkpoint(options.output);
  const std::set<std::string> scales = model::checked_fp8_scale_names(config, checkpoint);
  EXPECT_EQ(checkpoint.names().size(), model::synthetic_tensor_specs(config).size() + scales.size());
  for (const std::string& name : scales) EXPECT_EQ(checkpoint.info(name).dtype, model::Dtype::kF32) << name;
  EXPECT_EQ(checkpoint.info("model.layers.0.mlp.gate.weight").dtype, model::Dtype::kBF16);
  EXPECT_EQ(checkpoint.info("model.embed_tokens.weight").dtype, model::Dtype::kBF16);

  const model::SyntheticWeights weights(config, options.seed);
  for (const std::string& name : model::fp8_weight_names(config)) {
    const model::TensorInfo& info = checkpoint.info(name);
    ASSERT_EQ(info.dtype, model::Dtype::kF8E4M3) << name;
    std::vector<float> original;
    weights.produce(model::TensorSpec{name, info.shape}, [&](std::span<const float> chunk) {
      original.insert(original.end(), chunk.begin(), chunk.end());
    });
    std::vector<float> dequantized(original.size()), scale(static_cast<size_t>(checkpoint.info(name + "_scale_inv").numel()));
    checkpoint.read_f32_into(name, info.shape, dequantized);
    checkpoint.read_f32_into(name + "_scale_inv", checkpoint.info(name + "_scale_inv").shape, scale);
    const int64_t cols = info.shape[1], col_blocks = (cols + 127) / 128;
    for (size_t i = 0; i < original.size(); ++i) {
      const int64_t r = static_cast<int64_t>(i) / cols, c = static_cast<int64_t>(i) % cols;
      expect_within_fp8_rounding(dequantized[i], original[i], scale[(r / 128) * col_blocks + c / 128], name);
    }
  }
  // The CPU model loads it (no unexpected tensors) and runs.
  backend::CpuBackend cpu;
  model::Qwen3MoeModel qwen(config, cpu);
  qwen.load_weights(checkpoint);
  const std::vector<int32_t> prompt = {1, 17, 200, 3};
  model::KvCache cache = qwen.create_kv_cache(8);
  const model::SequenceInput seq{prompt, &cache};
  for (const float v : cpu.download(qwen.forward(std::span(&seq, 1))[0])) ASSERT_TRUE(std::isfinite(v));
  EXPECT_GT(result.bytes, 0u);
}

// A scale tensor the model has no weight for (the router's) is an unexpected tensor for the loader.
TEST(ModelFp8, LoaderRejectsScalesOfUnquantizedTensors) {
  TempDir tmp("fp8_make");
  const model::MakeModelOptions options = tiny_fp8_options(tmp, 1);
  model::make_model(options);
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(options.output);
  // Rewrite the file with the router stored as FP8 plus a scale: Checkpoint accepts the pair, the loader not.
  const model::SafetensorsFile original(options.output + "/model.safetensors");
  std::map<std::string, RawTensor> tensors;
  for (const std::string& name : original.names()) {
    const model::TensorInfo& info = original.info(name);
    std::vector<float> values(static_cast<size_t>(info.numel()));
    original.read_f32_into(name, values);
    if (info.dtype == model::Dtype::kF8E4M3) {
      std::string bytes;
      for (const float v : values) bytes.push_back(static_cast<char>(model::f32_to_f8e4m3_bits(v)));
      tensors[name] = {"F8_E4M3", info.shape, bytes};
    } else {
      tensors[name] = {"F32", info.shape, f32_bytes(values)};
    }
  }
  const std::string router = "model.layers.0.mlp.gate.weight";
  tensors[router] = {"F8_E4M3", tensors[router].shape, std::string(tensors[router].bytes.size() / 4, '\x38')};
  tensors[router + "_scale_inv"] = {"F32", {1, 1}, f32_bytes({1.0f})};
  write_raw_safetensors(options.output + "/model.safetensors", tensors);
  model::Checkpoint checkpoint(options.output);
  backend::CpuBackend cpu;
  model::Qwen3MoeModel qwen(config, cpu);
  expect_one_line_error([&] { qwen.load_weights(checkpoint); },
                        "unexpected tensor 'model.layers.0.mlp.gate.weight_scale_inv'");
}

}  // namespace
}  // namespace fulcrum::test
