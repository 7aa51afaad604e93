// make-model: random checkpoints load into Qwen3MoeModel with exactly the expected tensors, are
// deterministic per seed, shard when large, follow the real configs' shapes, and router skew reaches
// its documented fit. CLI errors are one line with a non-zero exit.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <sys/wait.h>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "eplb/error.hpp"
#include "model/make_model.hpp"
#include "model/qwen3_moe.hpp"
#include "model/synthetic_model.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

namespace fs = std::filesystem;
using model::Dtype;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

model::MakeModelOptions tiny_options(const std::string& output, int layers = 2) {
  model::MakeModelOptions options;
  options.preset = "tiny";
  options.output = output;
  options.layers = layers;
  options.seed = 7;
  return options;
}

// Loads the checkpoint, runs one forward; returns the logits of a short prompt.
std::vector<float> load_and_forward(const std::string& dir) {
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(dir);
  backend::CpuBackend backend;
  model::Qwen3MoeModel qwen(config, backend);
  model::Checkpoint checkpoint(dir);
  qwen.load_weights(checkpoint);  // rejects missing, mis-shaped and unexpected tensors
  const std::vector<int32_t> prompt = {1, 17, 200, 3, 255};
  model::KvCache cache = qwen.create_kv_cache(8);
  const model::SequenceInput seq{prompt, &cache};
  const auto logits = qwen.forward(std::span(&seq, 1));
  return backend.download(logits[0]);
}

TEST(MakeModelTest, TinyLoadsAndRunsInBothDtypes) {
  TempDir tmp("make_model");
  for (const Dtype dtype : {Dtype::kBF16, Dtype::kF32}) {
    auto options = tiny_options(tmp.file(model::dtype_name(dtype)));
    options.dtype = dtype;
    const model::MakeModelResult result = model::make_model(options);
    EXPECT_EQ(result.num_files, 1);
    const std::vector<float> logits = load_and_forward(options.output);
    ASSERT_EQ(logits.size(), 5u * 256u);
    for (const float v : logits) ASSERT_TRUE(std::isfinite(v));

    // Exactly the loader's tensors, with their shapes and the chosen dtype.
    model::Checkpoint checkpoint(options.output);
    const auto specs = model::synthetic_tensor_specs(result.config);
    std::vector<std::string> expected;
    for (const auto& spec : specs) {
      expected.push_back(spec.name);
      EXPECT_EQ(checkpoint.info(spec.name).shape, spec.shape) << spec.name;
      EXPECT_EQ(checkpoint.info(spec.name).dtype, dtype) << spec.name;
    }
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(checkpoint.names(), expected);
    EXPECT_TRUE(checkpoint.contains("model.layers.1.mlp.experts.127.down_proj.weight"));
    EXPECT_EQ(checkpoint.info("model.layers.0.mlp.gate.weight").shape, (std::vector<int64_t>{128, 64}));
    EXPECT_EQ(nlohmann::json::parse(slurp(options.output + "/config.json")).at("num_experts"), 128);
  }
  // The same seed gives the same values in both dtypes (bf16 = fp32 rounded).
  model::SafetensorsFile bf16(tmp.file("BF16") + "/model.safetensors"), f32(tmp.file("F32") + "/model.safetensors");
  const auto a = bf16.read_f32("model.layers.1.self_attn.q_proj.weight").data;
  auto b = f32.read_f32("model.layers.1.self_attn.q_proj.weight").data;
  model::round_to_dtype(b, Dtype::kBF16);
  EXPECT_EQ(a, b);
}

// The key layout is the one transformers writes: same names as the golden HF checkpoint of a 3-layer
// 128-expert Qwen3-MoE (shapes differ: the golden model has other head and MLP sizes).
TEST(MakeModelTest, KeysMatchTransformersLayout) {
  TempDir tmp("make_model");
  model::make_model(tiny_options(tmp.file("m"), 3));
  model::Checkpoint ours(tmp.file("m"));
  model::Checkpoint golden(golden_model_dir("qwen3moe-tiny-128e"));
  EXPECT_EQ(ours.names(), golden.names());
}

TEST(MakeModelTest, DeterministicPerSeed) {
  TempDir tmp("make_model");
  auto options = tiny_options(tmp.file("a"), 1);
  model::make_model(options);
  options.output = tmp.file("b");
  model::make_model(options);
  options.output = tmp.file("c");
  options.seed = 8;
  model::make_model(options);
  EXPECT_EQ(slurp(tmp.file("a") + "/model.safetensors"), slurp(tmp.file("b") + "/model.safetensors"));
  EXPECT_NE(slurp(tmp.file("a") + "/model.safetensors"), slurp(tmp.file("c") + "/model.safetensors"));
}

TEST(MakeModelTest, ShardsWithAnIndexWhenLarge) {
  TempDir tmp("make_model");
  auto options = tiny_options(tmp.file("sharded"));
  options.dtype = Dtype::kF32;
  options.max_shard_bytes = 1 << 20;
  const model::MakeModelResult result = model::make_model(options);
  EXPECT_GT(result.num_files, 1);
  EXPECT_TRUE(fs::exists(options.output + "/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(options.output + "/model.safetensors"));
  const auto index = nlohmann::json::parse(slurp(options.output + "/model.safetensors.index.json"));
  EXPECT_EQ(index.at("metadata").at("total_size"), result.bytes);
  // Sharding does not change the values.
  options.output = tmp.file("single");
  options.max_shard_bytes = uint64_t{1} << 30;
  model::make_model(options);
  EXPECT_EQ(load_and_forward(tmp.file("sharded")), load_and_forward(tmp.file("single")));
  // No staging folder is left behind.
  for (const auto& entry : fs::directory_iterator(tmp.path())) {
    EXPECT_EQ(entry.path().filename().string().rfind(".", 0), std::string::npos) << entry.path();
  }
}

TEST(MakeModelTest, RealPresetsTakeTheRealShapes) {
  for (const std::string name : {"qwen3-30b-a3b", "qwen3-235b-a22b"}) {
    const auto real = model::load_qwen3_moe_config(shared_path("data/configs/" + name + ".config.json"));
    const auto preset = model::parse_qwen3_moe_config(model::preset_config_json(name, {}), name);
    EXPECT_EQ(preset.vocab_size, real.vocab_size);
    EXPECT_EQ(preset.hidden_size, real.hidden_size);
    EXPECT_EQ(preset.intermediate_size, real.intermediate_size);
    EXPECT_EQ(preset.moe_intermediate_size, real.moe_intermediate_size);
    EXPECT_EQ(preset.num_hidden_layers, real.num_hidden_layers);
    EXPECT_EQ(preset.num_attention_heads, real.num_attention_heads);
    EXPECT_EQ(preset.num_key_value_heads, real.num_key_value_heads);
    EXPECT_EQ(preset.head_dim, real.head_dim);
    EXPECT_EQ(preset.num_experts, real.num_experts);
    EXPECT_EQ(preset.num_experts_per_tok, real.num_experts_per_tok);
    EXPECT_EQ(preset.norm_topk_prob, real.norm_topk_prob);
    EXPECT_EQ(preset.rope_theta, real.rope_theta);
    EXPECT_EQ(preset.max_position_embeddings, real.max_position_embeddings);
    const auto sliced = model::parse_qwen3_moe_config(model::preset_config_json(name, {2, 0, Dtype::kBF16}), name);
    EXPECT_EQ(sliced.num_hidden_layers, 2);
  }
}

TEST(MakeModelTest, LargePresetNeedsLayers) {
  TempDir tmp("make_model");
  model::MakeModelOptions options;
  options.preset = "qwen3-235b-a22b";
  options.output = tmp.file("big");
  try {
    model::make_model(options);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--layers"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(options.output));
}

// Documented tolerance: on the tiny preset (4 MoE layers, 128 experts, top-8) following a real
// Qwen3-30B-A3B load matrix, every layer's Pearson correlation between measured (fresh prompts) and
// target inclusion fractions is >= 0.9, the worst absolute error <= 0.06 (2048 calibration and 2048
// measurement tokens: binomial noise alone is ~0.01 per expert at fraction 0.5), and the trivial placement's
// balancedness on the measured routing is within 0.05 of its balancedness on the target loads.
TEST(MakeModelTest, RouterSkewFollowsRealLoads) {
  TempDir tmp("make_model");
  auto options = tiny_options(tmp.file("skewed"), 4);
  options.router_skew = shared_path("data/loads/qwen3-30b-a3b_prefill_gsm8k_en.csv");
  options.calibration.num_tokens = 2048;  // fewer than the CLI's default, for speed
  options.measure_tokens = 2048;
  const model::MakeModelResult result = model::make_model(options);
  ASSERT_TRUE(result.fit.has_value());
  const model::RouterFit& fit = *result.fit;
  std::cout << model::router_fit_text(fit);
  EXPECT_GE(fit.pearson_min, 0.9);
  EXPECT_LE(fit.max_abs_error_max, 0.06);
  ASSERT_EQ(fit.ranks, (std::vector<int>{8, 16, 32}));
  for (size_t i = 0; i < fit.ranks.size(); ++i) {
    EXPECT_NEAR(fit.trivial_balancedness_measured[i], fit.trivial_balancedness_target[i], 0.05) << fit.ranks[i];
  }
  // Skew is real: the target's trivial placement is clearly unbalanced at 32 ranks.
  EXPECT_LT(fit.trivial_balancedness_target[2], 0.9);
  EXPECT_TRUE(fs::exists(options.output + "/make_model_report.json"));
  load_and_forward(options.output);
}

void expect_one_line_error(const CliRun& run, const std::string& needle) {
  EXPECT_NE(run.exit_code, 0);
  ASSERT_FALSE(run.err.empty());
  EXPECT_EQ(run.err.find('\n'), run.err.size() - 1) << run.err;
  EXPECT_NE(run.err.find(needle), std::string::npos) << run.err;
}

TEST(MakeModelTest, CliErrorsAreOneLine) {
  TempDir tmp("make_model_cli");
  const std::string out = " --output " + tmp.file("m");
  expect_one_line_error(run_cli(tmp, "make-model --preset huge" + out), "unknown preset 'huge'");
  expect_one_line_error(run_cli(tmp, "make-model --preset tiny --layers 0" + out), "--layers");
  expect_one_line_error(run_cli(tmp, "make-model --preset tiny --layers -3" + out), "--layers");
  expect_one_line_error(run_cli(tmp, "make-model --preset tiny --layers two" + out), "--layers");
  expect_one_line_error(run_cli(tmp, "make-model --preset tiny --dtype fp4" + out), "unknown dtype 'fp4'");
  expect_one_line_error(run_cli(tmp, "make-model --preset qwen3-30b-a3b" + out), "--layers");
  const std::string loads = shared_path("data/loads/qwen3-30b-a3b_prefill_gsm8k_en.csv");
  expect_one_line_error(run_cli(tmp, "make-model --preset tiny --experts 64 --router-skew " + loads + out),
                        "128 experts, the model 64");
  EXPECT_FALSE(fs::exists(tmp.file("m")));
  // And a good run exits 0.
  EXPECT_EQ(run_cli(tmp, "make-model --preset tiny --layers 1 --experts 16" + out).exit_code, 0);
  EXPECT_TRUE(fs::exists(tmp.file("m") + "/model.safetensors"));
  expect_one_line_error(run_cli(tmp, "make-model --preset tiny --layers 1" + out), "not an empty folder");
}

}  // namespace
}  // namespace fulcrum::test

namespace fulcrum::test {
namespace {

// --tokenizer: the tokenizer.json lands beside the weights and vocab_size covers every id it can produce.
TEST(MakeModelTest, TokenizerBesideTheWeightsSizesTheVocabulary) {
  TempDir tmp("make_model_tokenizer");
  const std::string tokenizer = shared_path("golden/tokenizer/bpe-qwen-style-2k/tokenizer.json");
  const std::string out = tmp.file("m");
  const CliRun made = run_cli(tmp, "make-model --preset tiny --layers 1 --output " + out + " --tokenizer " + tokenizer);
  ASSERT_EQ(made.exit_code, 0) << made.err;
  EXPECT_EQ(slurp(out + "/tokenizer.json"), slurp(tokenizer));
  EXPECT_EQ(model::load_qwen3_moe_config(out).vocab_size, 2000);
  const CliRun ids = run_cli(tmp, "tokenize --model " + out + " --text 'Hello world'");
  EXPECT_EQ(ids.exit_code, 0) << ids.err;
  EXPECT_EQ(ids.out, "42 592 324 306 269 1513\n");
  const CliRun conflict = run_cli(tmp, "make-model --preset tiny --layers 1 --vocab-size 300 --output " + tmp.file("n") +
                                           " --tokenizer " + tokenizer);
  EXPECT_NE(conflict.exit_code, 0);
  EXPECT_NE(conflict.err.find("conflicts with --tokenizer"), std::string::npos) << conflict.err;
  EXPECT_FALSE(std::filesystem::exists(tmp.file("n")));
}

}  // namespace
}  // namespace fulcrum::test
