// The GPU engine (src/gpu/gpu_engine.hpp) end to end:
// - against Hugging Face transformers' fp32 outputs on the golden fixtures (bf16 engine vs fp32 oracle),
// - against itself: chunked vs one-shot prefill, a sequence alone vs in a batch, CUDA-graph replay vs eager
//   (bitwise), placements of the same experts (bitwise), page layouts,
// - bad input: prompts longer than the pool, unknown sequences.
//
// Tolerances. The engine stores weights, GEMM inputs, KV and expert intermediates in bf16 (8 significant bits,
// relative rounding 2^-9 = 0.2%) and accumulates in fp32; the golden outputs are fp32 throughout. Such
// roundings are independent and partly cancel: over a few layers the norm-relative logit error stays a few
// times 2^-9. We require ||engine - golden|| / ||golden|| <= kBf16LogitRelTolerance = 0.03 (about 15 x 2^-9:
// room for an occasional top-k router flip in the 128-expert model, whose router margins can be below bf16's
// resolution) and, where the golden top-1 margin exceeds 2 x the position's max error, the same argmax.
// Between two engine runs that differ only in batching or chunking (cuBLAS may pick other kernels by M, split
// attention differently), the same argument gives kBatchRelTolerance = 0.01 on logits. Graph replay and
// placement changes run the same kernels on the same rows in the same order: bitwise.
// FP8 fixture (qwen3moe-tiny-fp8): its experts run in FP8 on the device (the golden is the fp32 model with the
// dequantized weights, so the weights themselves are exact). Steps beyond the skinny bound quantize the expert
// activations to e4m3 per 1x128 block: 3 mantissa bits, a relative rounding error of at most 2^-4 and about
// 2^-4 / sqrt(3) = 3.6% RMS per element; a dot product of many such independently rounded terms keeps that
// relative RMS, and the two quantized GEMMs of an expert add in quadrature to ~5% of the expert output. The
// expert output is one branch of the residual stream, so logits move by at most that fraction of it:
// kFp8LogitRelTolerance = 0.08 with the engine's default bf16 dense projections. With fp8_dense_gemms its
// attention projections run in FP8 too (DenseGemm::run_fp8; the dense layer's MLP, intermediate 320, is off the
// 128 grid and stays bf16): the same steps quantize the inputs of the qkv and o GEMMs the same way, so the
// attention branch carries an error of the same order (~5%: two quantized GEMMs in quadrature; q and k off by
// ~3.6% each move the scores by ~5% of their size, which the softmax passes on scaled by the scores' spread).
// The two branches' errors are independent and add in quadrature: ~7% of the residual stream where both are
// of similar size, so kFp8DenseLogitRelTolerance = 0.1 (the bf16 roundings on top, and room for a router flip).
// The test prints the measured rel (on the H200: 0.005-0.007 and 0.005-0.057). Decode steps
// take the skinny paths (FP8 weights, bf16 activations): the bf16 argument holds for them.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <numeric>

#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/gpu_engine.hpp"
#include "model/rng.hpp"
#include "model/synthetic_model.hpp"
#include "eplb/error.hpp"
#include "model_golden_util.hpp"
#include "gpu_engine_test_util.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

constexpr double kBf16LogitRelTolerance = 0.03;
constexpr double kFp8LogitRelTolerance = 0.08;
constexpr double kFp8DenseLogitRelTolerance = 0.1;
constexpr double kBatchRelTolerance = 0.01;

double rel_error(std::span<const float> a, std::span<const float> ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), ref.size()); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return a.size() == ref.size() ? std::sqrt(num / std::max(den, 1e-30)) : INFINITY;
}

class GpuEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the GPU engine tests need a GPU";
  }
};

struct GoldenCase {
  const char* fixture;
  bool fp8_dense_gemms = false;  // GpuEngineOptions::fp8_dense_gemms (FP8 fixtures)
};

class GpuGoldenTest : public ::testing::TestWithParam<GoldenCase> {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the GPU engine tests need a GPU";
  }
};

TEST_P(GpuGoldenTest, LogitsAndGreedyFollowTransformers) {
  const std::string dir = golden_model_dir(GetParam().fixture);
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(dir);
  gpu::GpuEngineOptions options;
  options.fp8_dense_gemms = GetParam().fp8_dense_gemms;
  options.max_batch_tokens = 256;
  options.max_batch_seqs = 8;
  options.kv_pages = 64;
  gpu::GpuEngine engine(config, options);
  model::Checkpoint checkpoint(dir);
  engine.load(checkpoint);
  const std::vector<GoldenSequence> golden = read_golden(dir, static_cast<int>(config.moe_layer_indices().size()));
  for (size_t i = 0; i < golden.size(); ++i) {
    const GoldenSequence& g = golden[i];
    engine.allocate(static_cast<int64_t>(i), static_cast<int64_t>(g.input_ids.size()) + 8);
    const model::StepSequence prompt = entry(static_cast<int64_t>(i), g.input_ids, false);
    const std::vector<model::HostTensor> logits = engine.forward_logits(std::span(&prompt, 1));
    const double rel = rel_error(logits[0].data, g.logits.data);
    const double tolerance = !config.quantization ? kBf16LogitRelTolerance
                             : options.fp8_dense_gemms ? kFp8DenseLogitRelTolerance : kFp8LogitRelTolerance;
    EXPECT_LE(rel, tolerance) << "sequence " << i;
    const float worst = max_abs_diff(logits[0].data, g.logits.data);
    const int v = config.vocab_size;
    int compared = 0, agreed = 0;
    for (size_t t = 0; t < g.input_ids.size(); ++t) {
      const std::span<const float> mine(logits[0].data.data() + t * v, v), ref(g.logits.data.data() + t * v, v);
      std::vector<float> sorted(ref.begin(), ref.end());
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
      if (sorted[0] - sorted[1] <= 2 * worst) continue;
      ++compared;
      agreed += model::argmax(mine) == model::argmax(ref);
    }
    EXPECT_EQ(agreed, compared) << "sequence " << i;
    // Greedy decoding with the KV cache on the device sampler: the golden tokens while the margin is clear.
    std::vector<int32_t> tokens;
    int32_t last = model::argmax(std::span<const float>(logits[0].data).last(v));
    tokens.push_back(last);
    for (int s = 1; s < static_cast<int>(g.greedy_tokens.size()); ++s) {
      const model::StepSequence next = entry(static_cast<int64_t>(i), std::span(&last, 1), true);
      const model::StepOutput out = engine.step(std::span(&next, 1));
      ASSERT_TRUE(out.errors[0].empty()) << out.errors[0];
      last = out.tokens[0];
      tokens.push_back(last);
    }
    if (g.last_top1_margin > 2 * worst) {
      EXPECT_EQ(tokens[0], g.greedy_tokens[0]) << "sequence " << i;
    }
    std::cout << "[ gpu vs golden ] " << GetParam().fixture << (options.fp8_dense_gemms ? " fp8 dense" : "") << " seq " << i << ": rel " << rel << ", max abs " << worst
              << ", argmax " << agreed << "/" << compared << ", greedy " << fmt::format("{}", fmt::join(tokens, " "))
              << " (golden " << fmt::format("{}", fmt::join(g.greedy_tokens, " ")) << ")\n";
    engine.release(static_cast<int64_t>(i));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuGoldenTest,
                         ::testing::Values(GoldenCase{"qwen3moe-tiny-128e"}, GoldenCase{"qwen3moe-tiny-dense-mix"},
                                           GoldenCase{"qwen3moe-tiny-fp8"}, GoldenCase{"qwen3moe-tiny-fp8", true}),
                         [](const auto& info) {
                           std::string name = std::string(info.param.fixture) + (info.param.fp8_dense_gemms ? "_fp8_dense" : "");
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// Runs prompts (one step each, unless `chunk` > 0: chunks of that many tokens) and returns each prompt's
// last-position logits.
std::vector<std::vector<float>> last_logits(gpu::GpuEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                            int chunk, bool together) {
  std::vector<std::vector<float>> out(prompts.size());
  const int v = engine.vocab_size();
  const auto run = [&](std::vector<size_t> members) {
    std::vector<size_t> cursor(members.size(), 0);
    bool more = true;
    while (more) {
      std::vector<model::StepSequence> batch;
      std::vector<size_t> who;
      for (size_t k = 0; k < members.size(); ++k) {
        const auto& p = prompts[members[k]];
        if (cursor[k] == p.size()) continue;
        const size_t n = chunk > 0 ? std::min<size_t>(chunk, p.size() - cursor[k]) : p.size();
        batch.push_back(entry(static_cast<int64_t>(members[k]), std::span(p).subspan(cursor[k], n), false));
        who.push_back(members[k]);
        cursor[k] += n;
      }
      more = !batch.empty();
      if (!more) break;
      const auto logits = engine.forward_logits(batch);
      for (size_t k = 0; k < batch.size(); ++k) {
        out[who[k]].assign(logits[k].data.end() - v, logits[k].data.end());
      }
    }
  };
  for (size_t i = 0; i < prompts.size(); ++i) engine.allocate(static_cast<int64_t>(i), static_cast<int64_t>(prompts[i].size()) + 4);
  if (together) {
    std::vector<size_t> all(prompts.size());
    std::iota(all.begin(), all.end(), 0);
    run(all);
  } else {
    for (size_t i = 0; i < prompts.size(); ++i) run({i});
  }
  for (size_t i = 0; i < prompts.size(); ++i) engine.release(static_cast<int64_t>(i));
  return out;
}

gpu::GpuEngineOptions small_options() {
  gpu::GpuEngineOptions o;
  o.max_batch_tokens = 2048;
  o.max_batch_seqs = 16;
  o.kv_pages = 512;
  return o;
}

// Awkward lengths together, alone, and in chunks agree within the batching tolerance.
TEST_F(GpuEngineTest, RaggedBatchesAloneTogetherAndChunkedAgree) {
  const model::Qwen3MoeConfig config = small_config();
  gpu::GpuEngine engine(config, small_options());
  engine.fill_random(11);
  std::vector<std::vector<int32_t>> prompts;
  for (const int n : {1, 7, 33, 1030}) prompts.push_back(random_tokens(n, config.vocab_size, 100 + n));
  const auto together = last_logits(engine, prompts, 0, true);
  const auto alone = last_logits(engine, prompts, 0, false);
  const auto chunked = last_logits(engine, prompts, 100, true);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_LE(rel_error(together[i], alone[i]), kBatchRelTolerance) << "prompt " << i << " together vs alone";
    EXPECT_LE(rel_error(chunked[i], alone[i]), kBatchRelTolerance) << "prompt " << i << " chunked vs one shot";
    std::cout << "[ batching ] prompt of " << prompts[i].size() << ": together " << rel_error(together[i], alone[i])
              << ", chunked " << rel_error(chunked[i], alone[i]) << "\n";
  }
}

// Greedy decoding of a batch: the tokens and logprobs of graph replays equal those of eager steps, bit for bit.
std::vector<std::pair<int32_t, float>> decode_run(gpu::GpuEngineOptions options, int steps, gpu::GpuEngine::Counters* counters) {
  gpu::GpuEngine engine(small_config(), options);
  engine.fill_random(5);
  return greedy_decode(engine, /*batch=*/5, /*prompt_step=*/40, steps, counters);
}

TEST_F(GpuEngineTest, GraphReplayEqualsEagerBitwise) {
  gpu::GpuEngineOptions eager = small_options(), graphs = small_options();
  eager.cuda_graphs = false;
  gpu::GpuEngine::Counters c;
  const auto a = decode_run(eager, 12, nullptr);
  const auto b = decode_run(graphs, 12, &c);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first) << i;
    EXPECT_EQ(std::memcmp(&a[i].second, &b[i].second, 4), 0) << i << ": " << a[i].second << " vs " << b[i].second;
  }
  EXPECT_GE(c.graph_replays, 10) << "the decode steps should replay graphs";
}

// The device times of a step (CUDA events inside step()) are positive, the forward within the span, the span within
// the host's time of the call: prefill (eager) and decode (graph replays) steps.
TEST_F(GpuEngineTest, StepDeviceTimesLieInsideTheHostCall) {
  gpu::GpuEngineOptions o = small_options();
  o.time_steps = true;
  gpu::GpuEngine engine(small_config(), o);
  engine.fill_random(5);
  const std::vector<int32_t> prompt = random_tokens(300, engine.vocab_size(), 3);
  engine.allocate(0, 400);
  std::vector<int32_t> last{0};
  for (int s = 0; s < 8; ++s) {
    const std::vector<model::StepSequence> b{s == 0 ? entry(0, prompt, true) : entry(0, std::span(last), true)};
    const auto t0 = std::chrono::steady_clock::now();
    const model::StepOutput out = engine.step(b);
    const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(out.errors[0].empty()) << out.errors[0];
    last[0] = out.tokens[0];
    const gpu::GpuEngine::DeviceTimes d = engine.last_step_device_times();
    EXPECT_GT(d.forward_ms, 0.0) << "step " << s;
    EXPECT_LE(d.forward_ms, d.span_ms) << "step " << s;
    EXPECT_LE(d.span_ms, host_ms + 0.01) << "step " << s;  // events resolve ~0.5 us
  }
  EXPECT_GE(engine.counters().graph_replays, 5);
}

// The same experts in other slots (permuted, a hot expert replicated, dynamic replica choice splitting its
// tokens): the logits do not change by a bit.
TEST_F(GpuEngineTest, PlacementDoesNotChangeLogits) {
  const model::Qwen3MoeConfig config = small_config();
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(300, config.vocab_size, 1), random_tokens(17, config.vocab_size, 2)};
  const int num_moe = static_cast<int>(config.moe_layer_indices().size());
  const auto run = [&](const eplb::Placement& placement, eplb::DispatchAlgorithm dispatch) {
    gpu::GpuEngineOptions o = small_options();
    o.placement = placement;
    o.dispatch = dispatch;
    gpu::GpuEngine engine(config, o);
    engine.fill_random(21);
    return last_logits(engine, prompts, 0, true);
  };
  const eplb::Placement trivial = eplb::trivial_placement(eplb::Topology{config.num_experts, 1, 1}, num_moe, config.num_experts);
  eplb::Placement moved(eplb::Topology{config.num_experts + 8, 1, 1}, num_moe, config.num_experts);
  for (int l = 0; l < num_moe; ++l) {
    std::vector<int32_t> map(static_cast<size_t>(config.num_experts + 8));
    for (int s = 0; s < config.num_experts; ++s) map[s] = (s * 7 + l) % config.num_experts;  // a permutation
    for (int s = 0; s < 8; ++s) map[config.num_experts + s] = s % 3;                         // replicas of 3 experts
    std::copy(map.begin(), map.end(), moved.layer(l).begin());
  }
  const auto a = run(trivial, eplb::DispatchAlgorithm::kStatic);
  const auto b = run(moved, eplb::DispatchAlgorithm::kStatic);
  const auto c = run(moved, eplb::DispatchAlgorithm::kDynamic);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(a[i], b[i]) << "prompt " << i << " permuted + replicated, static";
    EXPECT_EQ(a[i], c[i]) << "prompt " << i << " permuted + replicated, dynamic";
  }
}

// Live EPLB on one GPU (issue 14's per-rank step): a greedy decode whose placement switches twice between steps
// while its decode graphs replay (slot s -> s % E with 8 replicas, then the experts permuted with replicas of 3
// hot experts, then another permutation) gives the tokens and logprobs of the run without switches bit for bit,
// captures no graph for the switches, and leaves every slot holding its expert's bytes (weights filled for the
// last placement from the start compare equal). Placements of another shape or missing an expert are one-line
// errors that move nothing.
TEST_F(GpuEngineTest, LivePlacementSwitchKeepsTokensAndGraphs) {
  const model::Qwen3MoeConfig config = small_config();
  const int num_moe = static_cast<int>(config.moe_layer_indices().size()), e = config.num_experts, p = e + 8;
  const eplb::Topology topo{p, 1, 1};
  const auto placement = [&](int mul, int add, int hot) {
    eplb::Placement pl(topo, num_moe, e);
    for (int l = 0; l < num_moe; ++l) {
      for (int s = 0; s < p; ++s) pl.layer(l)[s] = s < e ? (s * mul + add * l) % e : (s - e) % hot;
    }
    pl.validate();
    return pl;
  };
  const eplb::Placement start = placement(1, 0, e), second = placement(7, 1, 3), third = placement(5, 2, 5);
  gpu::GpuEngineOptions o = small_options();
  o.placement = start;
  gpu::GpuEngine::Counters fixed_counters, live_counters;
  std::vector<std::pair<int32_t, float>> fixed;
  {
    gpu::GpuEngine engine(config, o);
    engine.fill_random(31);
    fixed = greedy_decode(engine, 5, 40, 12, &fixed_counters);
  }
  gpu::GpuEngine engine(config, o);
  engine.fill_random(31);
  int64_t moved_second = 0, moved_third = 0;
  const auto live = greedy_decode(engine, 5, 40, 12, &live_counters, [&](int step) {
    if (step == 4) moved_second = engine.apply_placement(second);
    if (step == 8) moved_third = engine.apply_placement(third);
  });
  ASSERT_EQ(live.size(), fixed.size());
  for (size_t i = 0; i < live.size(); ++i) {
    EXPECT_EQ(live[i].first, fixed[i].first) << i;
    EXPECT_EQ(std::memcmp(&live[i].second, &fixed[i].second, 4), 0) << i << ": " << live[i].second << " vs " << fixed[i].second;
  }
  EXPECT_EQ(moved_second, eplb::experts_moved(start, second));
  EXPECT_EQ(moved_third, eplb::experts_moved(second, third));
  EXPECT_GT(moved_third, 0);
  EXPECT_GE(live_counters.graph_replays, 10) << "the decode steps should replay graphs";
  EXPECT_EQ(live_counters.graph_captures, fixed_counters.graph_captures) << "a switch forced a new capture";
  EXPECT_EQ(live_counters.graph_replays, fixed_counters.graph_replays);
  EXPECT_EQ(engine.placement().physical_to_logical_map, third.physical_to_logical_map);

  gpu::GpuEngineOptions o3 = small_options();
  o3.placement = third;
  gpu::GpuEngine filled(config, o3);
  filled.fill_random(31);
  for (int l = 0; l < num_moe; ++l) {
    for (int s = 0; s < p; ++s) {
      EXPECT_EQ(engine.weights().slot_pool()->download_slot(l, s), filled.weights().slot_pool()->download_slot(l, s))
          << "layer " << l << " slot " << s;
    }
  }

  eplb::Placement missing = third;  // an expert of layer 0 held once loses its slot
  const std::vector<int> counts = eplb::replica_counts(third.layer(0), e);
  const int lost = static_cast<int>(std::find(counts.begin(), counts.end(), 1) - counts.begin());
  ASSERT_LT(lost, e);
  for (int s = 0; s < p; ++s) {
    if (missing.layer(0)[s] == lost) missing.layer(0)[s] = (lost + 1) % e;
  }
  EXPECT_THROW(engine.apply_placement(missing), Error);
  const eplb::Placement other_shape = eplb::trivial_placement(eplb::Topology{e, 1, 1}, num_moe, e);
  EXPECT_THROW(engine.apply_placement(other_shape), Error);
  EXPECT_EQ(engine.placement().physical_to_logical_map, third.physical_to_logical_map) << "a refused placement moved slots";
}

// --weight-cache: the first start loads the checkpoint and writes the cache, the second loads the cache and gives
// the same logits bit for bit; a cache written for another placement, or a truncated one, is a one-line error.
TEST_F(GpuEngineTest, WeightCacheRoundTripsAndRefusesAnotherPlacement) {
  const std::string dir = golden_model_dir("qwen3moe-tiny-128e");
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(dir);
  const TempDir cache("gpu_weight_cache");
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(40, config.vocab_size, 3)};
  gpu::GpuEngineOptions o = small_options();
  o.kv_pages = 64;
  std::vector<std::vector<float>> first, second;
  {
    gpu::GpuEngine engine(config, o);
    EXPECT_FALSE(engine.load_weights(dir, cache.path()));
    first = last_logits(engine, prompts, 0, true);
  }
  ASSERT_TRUE(std::filesystem::exists(gpu::DeviceWeights::cache_file(cache.path())));
  {
    gpu::GpuEngine engine(config, o);
    EXPECT_TRUE(engine.load_weights(dir, cache.path()));
    second = last_logits(engine, prompts, 0, true);
  }
  EXPECT_EQ(first, second);

  const int num_moe = static_cast<int>(config.moe_layer_indices().size());
  eplb::Placement moved(eplb::Topology{config.num_experts, 1, 1}, num_moe, config.num_experts);
  for (int l = 0; l < num_moe; ++l) {
    for (int s = 0; s < config.num_experts; ++s) moved.layer(l)[s] = (s + 1) % config.num_experts;
  }
  gpu::GpuEngineOptions other = o;
  other.placement = moved;
  {
    gpu::GpuEngine engine(config, other);
    try {
      engine.load_weights(dir, cache.path());
      ADD_FAILURE() << "a cache of another placement was loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("slot_map"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
  }
  const std::string file = gpu::DeviceWeights::cache_file(cache.path());
  std::filesystem::resize_file(file, std::filesystem::file_size(file) / 2);
  gpu::GpuEngine engine(config, o);
  EXPECT_THROW(engine.load_weights(dir, cache.path()), Error);
}

// Prefix caching on the GPU engine (the scheduler's allocate_on_pages): a sequence whose first pages are another
// sequence's written prompt pages, prefilling only the rest, gives the logits of the whole prompt computed on
// fresh pages (within the chunking tolerance: the suffix is a second chunk over the shared KV), and leaves the
// shared pages' K/V as they were (the first sequence's next logits do not change).
TEST_F(GpuEngineTest, SharedPrefixPagesGiveTheWholePromptsLogits) {
  const model::Qwen3MoeConfig config = small_config();
  gpu::GpuEngineOptions o = small_options();
  o.page_size = 16;
  o.kv_pages = 64;
  gpu::GpuEngine engine(config, o);
  engine.fill_random(31);
  const std::vector<int32_t> prefix = random_tokens(64, config.vocab_size, 41);  // 4 whole pages
  std::vector<int32_t> a = prefix, b = prefix;
  for (const int32_t t : random_tokens(9, config.vocab_size, 42)) a.push_back(t);
  for (const int32_t t : random_tokens(21, config.vocab_size, 43)) b.push_back(t);
  const int v = engine.vocab_size();
  const auto last = [&](const std::vector<model::HostTensor>& logits) {
    return std::vector<float>(logits[0].data.end() - v, logits[0].data.end());
  };
  const std::vector<int32_t> pages_a = {0, 1, 2, 3, 4}, pages_b = {0, 1, 2, 3, 5, 6}, pages_c = {7, 8, 9, 10, 11, 12};
  engine.allocate_on_pages(1, {static_cast<int64_t>(a.size()) + 2, 0, pages_a, 0});
  const std::vector<model::StepSequence> run_a = {entry(1, a, false)};
  engine.forward_logits(run_a);
  engine.allocate_on_pages(2, {static_cast<int64_t>(b.size()) + 2, 0, pages_b, 64});
  const std::vector<model::StepSequence> run_b = {entry(2, std::span(b).subspan(64), false)};
  const std::vector<float> shared = last(engine.forward_logits(run_b));
  engine.allocate_on_pages(3, {static_cast<int64_t>(b.size()) + 2, 0, pages_c, 0});
  const std::vector<model::StepSequence> run_c = {entry(3, b, false)};
  const std::vector<float> whole = last(engine.forward_logits(run_c));
  const double rel = rel_error(shared, whole);
  EXPECT_LE(rel, kBatchRelTolerance);
  std::cout << "[ prefix cache ] suffix over shared pages vs whole prompt: rel " << rel << "\n";
  // Sequence 1 continues on its pages (the shared four included) as a sequence on fresh pages does.
  const int32_t next = 7;
  const std::vector<model::StepSequence> step_a = {entry(1, std::span(&next, 1), false)};
  const std::vector<float> after_a = last(engine.forward_logits(step_a));
  std::vector<int32_t> a_next = a;
  a_next.push_back(next);
  const std::vector<int32_t> pages_d = {13, 14, 15, 16, 17};
  engine.allocate_on_pages(4, {static_cast<int64_t>(a.size()) + 2, 0, pages_d, 0});
  const std::vector<model::StepSequence> run_d = {entry(4, a_next, false)};
  EXPECT_LE(rel_error(after_a, last(engine.forward_logits(run_d))), kBatchRelTolerance);
  // The pool's own allocation is refused once the caller chooses pages (two owners could hand out one page).
  EXPECT_THROW(engine.allocate(9, 10), Error);
}

// Copy on write of a partly shared page (SequencePages::copy_source_page): a sequence that shares another's 4
// whole prompt pages and the first 6 rows of its 5th, copied into a page of its own on every layer, prefilling
// from position 70, gives the logits of its whole prompt computed on fresh pages; the source page is left as
// it was (its owner goes on as a sequence on fresh pages does). A copy that does not fit the cached count is
// refused.
TEST_F(GpuEngineTest, PartlySharedPageCopiedOnWriteGivesTheWholePromptsLogits) {
  const model::Qwen3MoeConfig config = small_config();
  gpu::GpuEngineOptions o = small_options();
  o.page_size = 16;
  o.kv_pages = 64;
  gpu::GpuEngine engine(config, o);
  engine.fill_random(33);
  const std::vector<int32_t> prefix = random_tokens(70, config.vocab_size, 44);  // 4 pages and 6 rows
  std::vector<int32_t> a = prefix, b = prefix;
  for (const int32_t t : random_tokens(9, config.vocab_size, 45)) a.push_back(t);
  for (const int32_t t : random_tokens(21, config.vocab_size, 46)) b.push_back(t);
  const int v = engine.vocab_size();
  const auto last = [&](const std::vector<model::HostTensor>& logits) {
    return std::vector<float>(logits[0].data.end() - v, logits[0].data.end());
  };
  const int64_t cap_a = static_cast<int64_t>(a.size()) + 2, cap_b = static_cast<int64_t>(b.size()) + 2;
  const std::vector<int32_t> pages_a = {0, 1, 2, 3, 4, 5}, pages_b = {0, 1, 2, 3, 6, 7},
                             pages_c = {8, 9, 10, 11, 12, 13};
  engine.allocate_on_pages(1, {cap_a, 0, pages_a, 0});
  engine.forward_logits(std::vector<model::StepSequence>{entry(1, a, false)});
  EXPECT_THROW(engine.allocate_on_pages(2, {cap_b, 0, pages_b, 70}), Error);        // no copy source
  EXPECT_THROW(engine.allocate_on_pages(2, {cap_b, 0, pages_b, 64, 4}), Error);     // nothing to copy
  EXPECT_THROW(engine.allocate_on_pages(2, {cap_b, 0, pages_b, 70, 6}), Error);     // the source in its table
  engine.allocate_on_pages(2, {cap_b, 0, pages_b, 70, 4});  // rows [0, 6) of page 4 into page 6
  const std::vector<float> shared =
      last(engine.forward_logits(std::vector<model::StepSequence>{entry(2, std::span(b).subspan(70), false)}));
  engine.allocate_on_pages(3, {cap_b, 0, pages_c, 0});
  const std::vector<float> whole = last(engine.forward_logits(std::vector<model::StepSequence>{entry(3, b, false)}));
  const double rel = rel_error(shared, whole);
  EXPECT_LE(rel, kBatchRelTolerance);
  std::cout << "[ prefix cache ] suffix over a copied partial page vs whole prompt: rel " << rel << "\n";
  // Sequence 1 continues on its pages, page 4 included, as a sequence on fresh pages does.
  const int32_t next = 7;
  const std::vector<float> after_a =
      last(engine.forward_logits(std::vector<model::StepSequence>{entry(1, std::span(&next, 1), false)}));
  std::vector<int32_t> a_next = a;
  a_next.push_back(next);
  const std::vector<int32_t> pages_d = {14, 15, 16, 17, 18, 19};
  engine.allocate_on_pages(4, {cap_a, 0, pages_d, 0});
  EXPECT_LE(rel_error(after_a, last(engine.forward_logits(std::vector<model::StepSequence>{entry(4, a_next, false)}))),
            kBatchRelTolerance);
}

TEST_F(GpuEngineTest, BadRequestsAreOneLineErrors) {
  const model::Qwen3MoeConfig config = small_config(1);
  gpu::GpuEngineOptions o = small_options();
  o.kv_pages = 4;
  o.page_size = 16;
  gpu::GpuEngine engine(config, o);
  engine.fill_random(3);
  EXPECT_THROW(engine.allocate(1, 1000), Error);  // 63 pages of 4
  engine.allocate(1, 10);
  const std::vector<int32_t> eleven = random_tokens(11, config.vocab_size, 4);
  const model::StepSequence too_long = entry(1, eleven, true);
  EXPECT_THROW(engine.step(std::span(&too_long, 1)), Error);
  const model::StepSequence unknown = entry(2, std::span(eleven).first(2), true);
  EXPECT_THROW(engine.step(std::span(&unknown, 1)), Error);
  const std::vector<int32_t> bad_token = {config.vocab_size};
  const model::StepSequence bad = entry(1, bad_token, true);
  EXPECT_THROW(engine.step(std::span(&bad, 1)), Error);
  engine.release(1);
  engine.allocate(1, 64);  // every page is back
}

// A model or a KV pool larger than the GPU: a one-line error saying what is needed and what is free, before
// anything is allocated.
TEST_F(GpuEngineTest, WhatDoesNotFitIsRefusedWithItsSize) {
  const model::Qwen3MoeConfig big = model::parse_qwen3_moe_config(model::preset_config_json("qwen3-235b-a22b", {}), "235b");
  try {
    gpu::GpuEngine engine(big, small_options());
    FAIL() << "a 470 GB model fitted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("need"), std::string::npos) << what;
    EXPECT_NE(what.find("GiB free"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  gpu::GpuEngineOptions o = small_options();
  o.kv_pages = int64_t{1} << 28;  // 2^28 pages of 16 positions: terabytes
  try {
    gpu::GpuEngine engine(small_config(), o);
    FAIL() << "a KV pool of terabytes fitted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("KV pool"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fulcrum::test
