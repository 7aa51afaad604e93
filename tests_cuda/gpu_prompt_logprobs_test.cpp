// Prompt logprobs on the GPU engine (StepSequence::prompt_targets: OpenAI echo + logprobs, lm-eval's scoring
// request): the LM head over an entry's prompt rows, their log-softmax on the device (launch_top_logprobs with
// each row's target for the sampled token), only the values back to the host.
// - against the engine's own forward_logits of the same prompt (host log-softmax of those logits,
//   model::token_logprob: the same formula, its exp and log the host's) and against Hugging Face transformers' fp32 logits on the golden fixture qwen3moe-tiny-128e,
// - a prompt over two chunks against one chunk, a mixed batch (prompt rows of several entries beside decodes
//   and entries that ask nothing), graphs still replayed after such steps, bad targets refused,
// - a real `fulcrum serve --device cuda`: echo + logprobs + max_tokens 0 / 1 answers 200 with one entry a
//   position.
//
// Tolerances.
// kHeadTolerance = 2e-3 nats: a step's prompt rows and forward_logits' rows of the same batch run the same layers
// on the same rows (bitwise the same residual stream and final RMSNorm); only the LM-head GEMM differs in M (the
// skinny kernel for M <= 8, cuBLAS's kernel choice by M otherwise), i.e. the fp32 sum of the same K bf16 products
// in another order: at most K 2^-24 sum|x w| per logit (K <= 256 here, sum|x w| of O(10) for these weights: about
// 1e-4 at worst, ~1e-5 typically), and a logprob moves by at most twice its row's largest logit change
// (log-sum-exp is 1-Lipschitz in the max norm). The device's and the host's exp / log (double, a few ulps apart)
// add ~1e-15. A wrong row or target moves values by ~0.1 nats or more.
// Against transformers' fp32 logits: with e_j = max_i |forward_logits[j, i] - golden[j, i]| (the engine's bf16
// error on row j, bounded by gpu_engine_test's kBf16LogitRelTolerance argument), |logprob - golden logprob| <=
// 2 e_j + kHeadTolerance, by the same Lipschitz argument.
// Chunked vs one chunk: gpu_engine_test's kBatchRelTolerance = 0.01 bounds ||logits_chunked - logits_one|| /
// ||logits_one|| per row; since ||d||_inf <= ||d||_2, a logprob moves by at most 2 * 0.01 * ||logits_one row||_2.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_backend.hpp"
#include "eplb/error.hpp"
#include "gpu/gpu_engine.hpp"
#include "http_raw_client.hpp"
#include "model/rng.hpp"
#include "model_golden_util.hpp"
#include "gpu_engine_test_util.hpp"
#include "model_test_util.hpp"
#include "server_process.hpp"

namespace fulcrum::test {
namespace {

constexpr double kHeadTolerance = 2e-3;
constexpr double kBatchRelTolerance = 0.01;

class GpuPromptLogprobsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the GPU engine tests need a GPU";
  }
};

gpu::GpuEngineOptions small_options() {
  gpu::GpuEngineOptions o;
  o.max_batch_tokens = 2048;
  o.max_batch_seqs = 16;  // the head takes 256 rows a call: longer prompts take several
  o.kv_pages = 512;
  return o;
}

std::span<const float> row_of(const model::HostTensor& logits, int64_t row) {
  const auto v = static_cast<size_t>(logits.shape.at(1));
  return std::span<const float>(logits.data).subspan(static_cast<size_t>(row) * v, v);
}

double l2(std::span<const float> x) {
  double s = 0;
  for (const float f : x) s += double(f) * f;
  return std::sqrt(s);
}

// One prompt row's answer against the host log-softmax of the reference logits `ref_row`: the target's value
// and every listed top within kHeadTolerance, the tops in the interface's order, the best ones (no reference
// value above a listed one by more than the tolerance), and the target's own value where it is listed, bitwise.
void expect_row_matches(const model::TokenLogprob& got, std::span<const float> ref_row, int32_t target, int num_top,
                        const std::string& where) {
  const model::TokenLogprob want = model::token_logprob_with_top(ref_row, target, num_top);
  EXPECT_NEAR(got.logprob, want.logprob, kHeadTolerance) << where;
  ASSERT_EQ(got.top_ids.size(), static_cast<size_t>(num_top)) << where;
  ASSERT_EQ(got.top_logprobs.size(), static_cast<size_t>(num_top)) << where;
  for (int m = 0; m < num_top; ++m) {
    const int32_t id = got.top_ids[static_cast<size_t>(m)];
    const float value = got.top_logprobs[static_cast<size_t>(m)];
    ASSERT_GE(id, 0) << where;
    ASSERT_LT(id, static_cast<int32_t>(ref_row.size())) << where;
    EXPECT_LE(value, 0.0f) << where;
    EXPECT_NEAR(value, model::token_logprob(ref_row, id), kHeadTolerance) << where << " top " << m;
    EXPECT_GE(value, want.top_logprobs[static_cast<size_t>(m)] - 2 * kHeadTolerance) << where << " top " << m;
    if (id == target) {
      EXPECT_EQ(value, got.logprob) << where << ": the target's value and its top entry";
    }
    if (m > 0) {
      const float before = got.top_logprobs[static_cast<size_t>(m - 1)];
      EXPECT_TRUE(before > value || (before == value && got.top_ids[static_cast<size_t>(m - 1)] < id))
          << where << ": tops out of order at " << m;
    }
  }
  if (num_top > 0) {
    EXPECT_GE(got.top_logprobs[0], got.logprob) << where;
  }
}

// The golden prompts as one step each (prompt targets: every position after the first, top 5, sampling greedily)
// against forward_logits of the same prompt on a twin sequence and against transformers' logits.
TEST_F(GpuPromptLogprobsTest, GoldenPromptMatchesForwardLogitsAndTransformers) {
  const std::string dir = golden_model_dir("qwen3moe-tiny-128e");
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(dir);
  gpu::GpuEngineOptions options;
  options.max_batch_tokens = 256;
  options.max_batch_seqs = 8;
  options.kv_pages = 64;
  gpu::GpuEngine engine(config, options);
  model::Checkpoint checkpoint(dir);
  engine.load(checkpoint);
  ASSERT_TRUE(engine.supports_prompt_logprobs());
  const std::vector<GoldenSequence> golden = read_golden(dir, static_cast<int>(config.moe_layer_indices().size()));
  constexpr int kTop = 5;
  for (size_t i = 0; i < golden.size(); ++i) {
    const std::vector<int32_t>& prompt = golden[i].input_ids;
    const auto n = static_cast<int64_t>(prompt.size());
    const model::SequenceId twin = 100 + static_cast<int64_t>(i), id = static_cast<int64_t>(i);
    engine.allocate(twin, n + 2);
    engine.allocate(id, n + 2);
    const model::StepSequence whole = entry(twin, prompt, false);
    const model::HostTensor ref = engine.forward_logits(std::span(&whole, 1))[0];
    model::StepSequence asks = entry(id, prompt, true);
    asks.want_logprob = true;
    asks.top_logprobs = kTop;
    asks.prompt_targets = std::span(prompt).subspan(1);
    const model::StepOutput out = engine.step(std::span(&asks, 1));
    ASSERT_TRUE(out.errors[0].empty()) << out.errors[0];
    ASSERT_EQ(out.prompt_logprobs[0].size(), static_cast<size_t>(n - 1));
    double worst_vs_engine = 0, worst_vs_golden = 0;
    for (int64_t j = 0; j + 1 < n; ++j) {  // row j predicts prompt[j + 1]
      const model::TokenLogprob& got = out.prompt_logprobs[0][static_cast<size_t>(j)];
      const int32_t target = prompt[static_cast<size_t>(j + 1)];
      const std::string where = fmt::format("sequence {} row {}", i, j);
      expect_row_matches(got, row_of(ref, j), target, kTop, where);
      const std::span<const float> gold_row = row_of(golden[i].logits, j);
      const double gold = model::token_logprob(gold_row, target);
      const double e = max_abs_diff(row_of(ref, j), gold_row);
      EXPECT_LE(std::abs(got.logprob - gold), 2 * e + kHeadTolerance) << where << " vs transformers";
      worst_vs_engine = std::max(worst_vs_engine, std::abs(double(got.logprob) - model::token_logprob(row_of(ref, j), target)));
      worst_vs_golden = std::max(worst_vs_golden, std::abs(got.logprob - gold));
    }
    // The sampling row of the same step: its logits are not disturbed by the prompt rows' head (greedy token, logprob).
    const std::span<const float> last = row_of(ref, n - 1);
    std::vector<float> sorted(last.begin(), last.end());
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    if (sorted[0] - sorted[1] > 2 * kHeadTolerance) {
      EXPECT_EQ(out.tokens[0], model::argmax(last)) << "sequence " << i;
    }
    ASSERT_GE(out.tokens[0], 0);
    EXPECT_NEAR(out.logprobs[0], model::token_logprob(last, out.tokens[0]), kHeadTolerance) << "sequence " << i;
    std::cout << "[ prompt logprobs ] golden seq " << i << " (" << n << " tokens): max |d| vs forward_logits "
              << worst_vs_engine << ", vs transformers " << worst_vs_golden << "\n";
    engine.release(id);
    engine.release(twin);
  }
}

// Prompt logprobs of a sequence prefilled in `chunks` (token counts; the last chunk samples), as the scheduler asks
// them: every chunk's predicting rows, the last row of a non-final chunk predicting the next chunk's first token.
std::vector<model::TokenLogprob> chunked_prompt_logprobs(gpu::GpuEngine& engine, model::SequenceId id,
                                                         const std::vector<int32_t>& prompt, const std::vector<int>& chunks,
                                                         int num_top) {
  std::vector<model::TokenLogprob> all;
  size_t at = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const auto n = static_cast<size_t>(chunks[c]);
    const bool last = c + 1 == chunks.size();
    model::StepSequence s = entry(id, std::span(prompt).subspan(at, n), last);
    s.top_logprobs = num_top;
    s.want_logprob = num_top > 0;
    const size_t first = at + 1, end = std::min(at + n, prompt.size() - 1);  // targets [first, end]
    s.prompt_targets = std::span(prompt).subspan(first, end - first + 1);
    const model::StepOutput out = engine.step(std::span(&s, 1));
    EXPECT_TRUE(out.errors[0].empty()) << out.errors[0];
    EXPECT_EQ(out.prompt_logprobs[0].size(), s.prompt_targets.size()) << "chunk " << c;
    for (const model::TokenLogprob& lp : out.prompt_logprobs[0]) all.push_back(lp);
    at += n;
  }
  return all;
}

// forward_logits of a prompt in `chunks`: the rows that predict a prompt token, [prompt - 1, V] in order.
std::vector<float> chunked_reference_rows(gpu::GpuEngine& engine, model::SequenceId id, const std::vector<int32_t>& prompt,
                                          const std::vector<int>& chunks) {
  std::vector<float> rows;
  size_t at = 0;
  for (const int chunk : chunks) {
    const auto n = static_cast<size_t>(chunk);
    const model::StepSequence s = entry(id, std::span(prompt).subspan(at, n), false);
    const model::HostTensor logits = engine.forward_logits(std::span(&s, 1))[0];
    const size_t keep = at + n == prompt.size() ? n - 1 : n;  // the prompt's last row predicts no prompt token
    rows.insert(rows.end(), logits.data.begin(), logits.data.begin() + static_cast<ptrdiff_t>(keep * engine.vocab_size()));
    at += n;
  }
  return rows;
}

// A prompt of 520 tokens in one chunk (519 prompt rows: two whole head calls of 256 rows and a skinny one of 7)
// and in chunks of 300 + 220 (the first chunk's last row predicts the second's first token): each against
// forward_logits in the same chunks within kHeadTolerance, and chunked against one chunk within the batching bound.
TEST_F(GpuPromptLogprobsTest, PromptOverTwoChunksMatchesOneChunk) {
  const model::Qwen3MoeConfig config = small_config();
  gpu::GpuEngine engine(config, small_options());
  engine.fill_random(17);
  const std::vector<int32_t> prompt = random_tokens(520, config.vocab_size, 23);
  const auto cap = static_cast<int64_t>(prompt.size()) + 2;
  for (int id = 1; id <= 4; ++id) engine.allocate(id, cap);
  constexpr int kTop = 3;
  const std::vector<int> two = {300, 220}, one = {520};
  const std::vector<model::TokenLogprob> chunked = chunked_prompt_logprobs(engine, 1, prompt, two, kTop);
  const std::vector<model::TokenLogprob> whole = chunked_prompt_logprobs(engine, 2, prompt, one, kTop);
  const std::vector<float> ref_chunked = chunked_reference_rows(engine, 3, prompt, two);
  const std::vector<float> ref_whole = chunked_reference_rows(engine, 4, prompt, one);
  const size_t rows = prompt.size() - 1, v = static_cast<size_t>(config.vocab_size);
  ASSERT_EQ(chunked.size(), rows);
  ASSERT_EQ(whole.size(), rows);
  ASSERT_EQ(ref_chunked.size(), rows * v);
  ASSERT_EQ(ref_whole.size(), rows * v);
  double worst = 0, worst_bound_ratio = 0;
  for (size_t j = 0; j < rows; ++j) {
    const int32_t target = prompt[j + 1];
    const std::span<const float> rc(ref_chunked.data() + j * v, v), rw(ref_whole.data() + j * v, v);
    expect_row_matches(chunked[j], rc, target, kTop, fmt::format("chunked row {}", j));
    expect_row_matches(whole[j], rw, target, kTop, fmt::format("one-chunk row {}", j));
    const double d = std::abs(double(chunked[j].logprob) - whole[j].logprob), bound = 2 * kBatchRelTolerance * l2(rw);
    EXPECT_LE(d, bound) << "row " << j << ": chunked vs one chunk";
    worst = std::max(worst, d);
    worst_bound_ratio = std::max(worst_bound_ratio, d / bound);
  }
  std::cout << "[ prompt logprobs ] 300 + 220 vs 520 in one chunk: max |d| " << worst << " (" << worst_bound_ratio
            << " of the bound)\n";
}

// One step holding a prompt chunk that does not sample (targets up to its last row), a decode, a prompt chunk that
// samples without prompt logprobs, and one that samples with them (no top): each entry gets what it asked, its
// rows' values match forward_logits of the same batch on twin sequences; the step runs eagerly and decode steps
// after it still replay graphs.
TEST_F(GpuPromptLogprobsTest, MixedBatchGivesEachEntryItsRows) {
  const model::Qwen3MoeConfig config = small_config();
  gpu::GpuEngine engine(config, small_options());
  engine.fill_random(29);
  const int v = config.vocab_size;
  const std::vector<int32_t> a = random_tokens(40, v, 1), b_prompt = random_tokens(25, v, 2), c = random_tokens(9, v, 3),
                             d = random_tokens(33, v, 4);
  const model::SequenceId twin = 10;  // sequence k's twin is twin + k
  for (int k = 0; k < 4; ++k) {
    engine.allocate(k, 64);
    engine.allocate(twin + k, 64);
  }
  // Sequence 1's prompt, alone on both: the same layers, so the same KV on both.
  const model::StepSequence b_first = entry(1, b_prompt, true), b_first_twin = entry(twin + 1, b_prompt, false);
  const model::StepOutput first = engine.step(std::span(&b_first, 1));
  ASSERT_TRUE(first.errors[0].empty()) << first.errors[0];
  engine.forward_logits(std::span(&b_first_twin, 1));
  const int32_t b_next = first.tokens[0];

  std::vector<model::StepSequence> batch = {entry(0, std::span(a).first(30), false), entry(1, std::span(&b_next, 1), true),
                                            entry(2, c, true), entry(3, d, true)};
  batch[0].prompt_targets = std::span(a).subspan(11, 20);  // rows 10..29 of 30: the last predicts a[30]
  batch[0].top_logprobs = 4;
  batch[1].want_logprob = true;
  batch[1].top_logprobs = 4;
  batch[3].prompt_targets = std::span(d).subspan(2, 31);  // rows 1..31 of 33 (row 32 samples)
  std::vector<model::StepSequence> twins = batch;
  for (model::StepSequence& s : twins) {
    s.id += twin;
    s.sample = false;
    s.prompt_targets = {};
  }
  const gpu::GpuEngine::Counters before = engine.counters();
  const model::StepOutput out = engine.step(batch);
  EXPECT_EQ(engine.counters().eager_steps, before.eager_steps + 1);
  EXPECT_EQ(engine.counters().graph_replays, before.graph_replays);
  const std::vector<model::HostTensor> ref = engine.forward_logits(twins);
  for (size_t i = 0; i < batch.size(); ++i) ASSERT_TRUE(out.errors[i].empty()) << i << ": " << out.errors[i];
  ASSERT_EQ(out.prompt_logprobs[0].size(), 20u);
  EXPECT_TRUE(out.prompt_logprobs[1].empty());
  EXPECT_TRUE(out.prompt_logprobs[2].empty());
  ASSERT_EQ(out.prompt_logprobs[3].size(), 31u);
  for (size_t j = 0; j < 20; ++j) {
    expect_row_matches(out.prompt_logprobs[0][j], row_of(ref[0], 10 + static_cast<int64_t>(j)), a[11 + j], 4,
                       fmt::format("entry 0 row {}", 10 + j));
  }
  for (size_t j = 0; j < 31; ++j) {
    expect_row_matches(out.prompt_logprobs[3][j], row_of(ref[3], 1 + static_cast<int64_t>(j)), d[2 + j], 0,
                       fmt::format("entry 3 row {}", 1 + j));
  }
  EXPECT_EQ(out.tokens[0], -1);
  // The sampling rows beside the prompt rows: greedy tokens where the margin is clear, the decode's logprob.
  for (const size_t i : {size_t{1}, size_t{2}, size_t{3}}) {
    const std::span<const float> last = row_of(ref[i], ref[i].shape[0] - 1);
    std::vector<float> sorted(last.begin(), last.end());
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    if (sorted[0] - sorted[1] > 2 * kHeadTolerance) {
      EXPECT_EQ(out.tokens[i], model::argmax(last)) << "entry " << i;
    }
  }
  ASSERT_GE(out.tokens[1], 0);
  EXPECT_NEAR(out.logprobs[1], model::token_logprob(row_of(ref[1], 0), out.tokens[1]), kHeadTolerance);
  EXPECT_EQ(out.top_logprobs[1].top_ids.size(), 4u);

  // Decodes of sequences 1..3 afterwards: captured once, then replayed.
  std::vector<int32_t> last = {out.tokens[1], out.tokens[2], out.tokens[3]};
  for (int s = 0; s < 4; ++s) {
    std::vector<model::StepSequence> decode;
    for (int k = 0; k < 3; ++k) decode.push_back(entry(k + 1, std::span(&last[static_cast<size_t>(k)], 1), true));
    const model::StepOutput o = engine.step(decode);
    for (int k = 0; k < 3; ++k) {
      ASSERT_TRUE(o.errors[static_cast<size_t>(k)].empty()) << o.errors[static_cast<size_t>(k)];
      EXPECT_TRUE(o.prompt_logprobs[static_cast<size_t>(k)].empty());
      last[static_cast<size_t>(k)] = o.tokens[static_cast<size_t>(k)];
    }
  }
  EXPECT_GE(engine.counters().graph_replays, before.graph_replays + 2) << "decode steps after a prompt step replay graphs";
}

// Targets the interface does not allow: more than the predicting rows (the sampling row predicts nothing known),
// ids outside the vocabulary. One-line errors before anything runs; the sequence then steps as if never asked.
TEST_F(GpuPromptLogprobsTest, BadTargetsAreOneLineErrors) {
  const model::Qwen3MoeConfig config = small_config();
  gpu::GpuEngine engine(config, small_options());
  engine.fill_random(3);
  engine.allocate(1, 16);
  const std::vector<int32_t> tokens = random_tokens(3, config.vocab_size, 5);
  const std::vector<int32_t> three = {1, 2, 3}, outside = {1, config.vocab_size};
  const auto expect_error = [&](model::StepSequence s, const char* what) {
    try {
      engine.step(std::span(&s, 1));
      ADD_FAILURE() << what << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
  };
  model::StepSequence s = entry(1, tokens, true);
  s.prompt_targets = three;  // 3 targets, 2 predicting rows
  expect_error(s, "three targets for two rows");
  s.prompt_targets = outside;
  expect_error(s, "a target outside the vocabulary");
  s.prompt_targets = std::span(three).first(2);
  const model::StepOutput out = engine.step(std::span(&s, 1));
  ASSERT_TRUE(out.errors[0].empty()) << out.errors[0];
  EXPECT_EQ(out.prompt_logprobs[0].size(), 2u);
}

// The HTTP front over the GPU engine: lm-eval's scoring request (token-id prompt, echo, logprobs 1, max_tokens 0
// and 1) over prompt chunks of 8 tokens answers 200 with one logprob a position (the first null), each a
// log-probability near the engine's own one-chunk value (the batching bound), and the greedy top-1 consistent.
TEST_F(GpuPromptLogprobsTest, ServeEchoLogprobsOnTheGpu) {
  const std::string dir = golden_model_dir("qwen3moe-tiny-128e");
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(dir);
  const std::vector<int32_t> prompt = random_tokens(19, config.vocab_size, 9);
  // The reference: forward_logits of the whole prompt on an engine of this process.
  model::HostTensor ref;
  {
    gpu::GpuEngineOptions options;
    options.max_batch_tokens = 64;
    options.max_batch_seqs = 4;
    options.kv_pages = 16;
    gpu::GpuEngine engine(config, options);
    model::Checkpoint checkpoint(dir);
    engine.load(checkpoint);
    engine.allocate(1, static_cast<int64_t>(prompt.size()));
    const model::StepSequence whole = entry(1, prompt, false);
    ref = engine.forward_logits(std::span(&whole, 1))[0];
  }
  const TempDir tmp("gpu_serve_echo");
  ServerProcess server(dir, {"--device", "cuda", "--kv-pages", "64", "--max-prefill-tokens", "8", "--max-running-requests", "4"},
                       tmp.path() + "/serve.log");
  for (const int max_tokens : {0, 1}) {
    const nlohmann::json request = {{"prompt", prompt}, {"temperature", 0}, {"max_tokens", max_tokens}, {"logprobs", 1},
                                    {"echo", true}};
    const std::string body = request.dump();
    const std::optional<RawResponse> response = post_json(server.port(), "/v1/completions", body, 60);
    ASSERT_TRUE(response.has_value()) << server.log();
    ASSERT_EQ(response->status, 200) << response->body << "\n" << server.log();
    const nlohmann::json reply = nlohmann::json::parse(response->body);
    const nlohmann::json& lp = reply["choices"][0]["logprobs"];
    const size_t n = prompt.size() + static_cast<size_t>(max_tokens);
    ASSERT_EQ(lp["token_logprobs"].size(), n) << lp.dump();
    ASSERT_EQ(lp["tokens"].size(), n);
    ASSERT_EQ(lp["top_logprobs"].size(), n);
    EXPECT_TRUE(lp["token_logprobs"][0].is_null());
    EXPECT_TRUE(lp["top_logprobs"][0].is_null());
    for (size_t pos = 1; pos < prompt.size(); ++pos) {
      ASSERT_TRUE(lp["token_logprobs"][pos].is_number()) << "position " << pos << ": " << lp.dump();
      const double value = lp["token_logprobs"][pos].get<double>();
      const std::span<const float> row = row_of(ref, static_cast<int64_t>(pos) - 1);
      EXPECT_LE(value, 0.0) << "position " << pos;
      EXPECT_NEAR(value, model::token_logprob(row, prompt[pos]), 2 * kBatchRelTolerance * l2(row)) << "position " << pos;
      ASSERT_EQ(lp["top_logprobs"][pos].size(), 1u) << "position " << pos;
      EXPECT_GE(lp["top_logprobs"][pos].begin().value().get<double>(), value) << "position " << pos;
    }
    EXPECT_EQ(reply["usage"]["completion_tokens"].get<int>(), max_tokens);
    EXPECT_EQ(reply["usage"]["prompt_tokens"].get<size_t>(), prompt.size());
  }
}

}  // namespace
}  // namespace fulcrum::test
