// model::sample_entry, the host sampling of a StepModel entry: greedy, a seeded draw equal to sample_token's,
// logprobs against a direct log-softmax, per-entry errors that leave the other entries valid.
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "eplb/error.hpp"
#include "model/step_model.hpp"

namespace fulcrum::model {
namespace {

// 19 awkward logits: negatives, a tie for the maximum (tokens 4 and 11), a masked token, a wide range.
std::vector<float> test_logits() {
  std::vector<float> logits(19);
  Rng rng(5);
  for (float& v : logits) v = static_cast<float>(4.0 * rng.unit_uniform());
  logits[4] = 9.5f;
  logits[11] = 9.5f;
  logits[7] = -std::numeric_limits<float>::infinity();
  logits[15] = -40.0f;
  return logits;
}

// log_softmax(logits)[token] computed directly in long double, no shift.
double direct_logprob(const std::vector<float>& logits, int token) {
  long double total = 0;
  for (const float v : logits) total += std::exp(static_cast<long double>(v));
  return static_cast<double>(static_cast<long double>(logits[static_cast<size_t>(token)]) - std::log(total));
}

StepSequence sampling_entry(SamplingParams params, double uniform = 0.0, bool want_logprob = false) {
  StepSequence seq;
  seq.sample = true;
  seq.sampling = params;
  seq.uniform = uniform;
  seq.want_logprob = want_logprob;
  return seq;
}

TEST(StepModelSampleEntry, MakeStepOutputHasNothingSampled) {
  const StepOutput out = make_step_output(3);
  ASSERT_EQ(out.tokens.size(), 3u);
  ASSERT_EQ(out.logprobs.size(), 3u);
  ASSERT_EQ(out.errors.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(out.tokens[i], -1);
    EXPECT_TRUE(std::isnan(out.logprobs[i]));
    EXPECT_TRUE(out.errors[i].empty());
  }
  EXPECT_TRUE(make_step_output(0).tokens.empty());
}

TEST(StepModelSampleEntry, GreedyIsTheArgmaxWithLowestIdOnTiesAndIgnoresTheUniform) {
  const std::vector<float> logits = test_logits();
  StepOutput out = make_step_output(2);
  sample_entry(logits, sampling_entry({}, 0.0), out, 0);
  sample_entry(logits, sampling_entry({}, 0.999), out, 1);
  EXPECT_EQ(out.tokens[0], 4);
  EXPECT_EQ(out.tokens[1], 4);
  EXPECT_TRUE(std::isnan(out.logprobs[0])) << "a logprob nobody asked for";
  EXPECT_TRUE(out.errors[0].empty());
}

TEST(StepModelSampleEntry, AnEntryThatDoesNotSampleIsLeftAlone) {
  const std::vector<float> logits = test_logits();
  StepOutput out = make_step_output(1);
  StepSequence seq = sampling_entry({.temperature = 1.0f}, 0.5, true);
  seq.sample = false;
  sample_entry(logits, seq, out, 0);
  EXPECT_EQ(out.tokens[0], -1);
  EXPECT_TRUE(std::isnan(out.logprobs[0]));
  EXPECT_TRUE(out.errors[0].empty());
}

// With the uniform drawn from an Rng exactly as the scheduler does, the tokens are sample_token's with an
// Rng of the same seed, draw after draw.
TEST(StepModelSampleEntry, ASeededDrawEqualsSampleToken) {
  const std::vector<float> logits = test_logits();
  for (const SamplingParams params : {SamplingParams{.temperature = 1.0f},
                                      SamplingParams{.temperature = 0.7f, .top_p = 0.9f, .top_k = 5},
                                      SamplingParams{.temperature = 3.0f, .top_p = 0.5f}}) {
    Rng ours(99), reference(99);
    int num_not_argmax = 0;
    for (int draw = 0; draw < 200; ++draw) {
      StepOutput out = make_step_output(1);
      sample_entry(logits, sampling_entry(params, ours.uniform()), out, 0);
      const int expected = sample_token(logits, params, reference);
      ASSERT_EQ(out.tokens[0], expected) << "draw " << draw << " temperature " << params.temperature;
      num_not_argmax += expected != 4;
    }
    EXPECT_GT(num_not_argmax, 0) << "the draws never left the argmax: the test shows nothing";
    EXPECT_EQ(ours.next(), reference.next());
  }
}

TEST(StepModelSampleEntry, LogprobIsTheFullVocabularyLogSoftmaxAtTemperatureOne) {
  const std::vector<float> logits = test_logits();
  // Whatever the sampling temperature, top_k and top_p, the logprob is over every logit at temperature 1.
  for (const SamplingParams params : {SamplingParams{}, SamplingParams{.temperature = 2.0f, .top_p = 0.3f, .top_k = 2},
                                      SamplingParams{.temperature = 0.5f}}) {
    for (const double uniform : {0.0, 0.3, 0.9999}) {
      StepOutput out = make_step_output(1);
      sample_entry(logits, sampling_entry(params, uniform, true), out, 0);
      ASSERT_GE(out.tokens[0], 0);
      // float result; the shifted double sum is exact to about 1e-15, the float rounding to ~6e-8 relative.
      EXPECT_NEAR(out.logprobs[0], direct_logprob(logits, out.tokens[0]), 1e-6) << "token " << out.tokens[0];
      EXPECT_FLOAT_EQ(out.logprobs[0], token_logprob(logits, out.tokens[0]));
    }
  }
  // One finite logit among masked ones: probability 1.
  const float ninf = -std::numeric_limits<float>::infinity();
  StepOutput out = make_step_output(1);
  sample_entry(std::vector<float>{ninf, 3.0f, ninf}, sampling_entry({.temperature = 1.0f}, 0.7, true), out, 0);
  EXPECT_EQ(out.tokens[0], 1);
  EXPECT_EQ(out.logprobs[0], 0.0f);
  // Large logits do not overflow (the sum is shifted by the maximum).
  out = make_step_output(1);
  sample_entry(std::vector<float>{1000.0f, 1000.0f, 999.0f}, sampling_entry({}, 0.0, true), out, 0);
  EXPECT_EQ(out.tokens[0], 0);
  EXPECT_NEAR(out.logprobs[0], -std::log(2.0 + std::exp(-1.0)), 1e-6);
}

TEST(StepModelSampleEntry, ABadEntryGetsAnErrorAndTheOthersAreValid) {
  const std::vector<float> good = test_logits();
  std::vector<float> nan_row = good;
  nan_row[3] = std::nanf("");
  std::vector<float> inf_row = good;
  inf_row[0] = std::numeric_limits<float>::infinity();
  const std::vector<float> all_masked(5, -std::numeric_limits<float>::infinity());

  StepOutput out = make_step_output(6);
  sample_entry(good, sampling_entry({}, 0.0, true), out, 0);
  sample_entry(nan_row, sampling_entry({.temperature = 1.0f}, 0.5, true), out, 1);
  sample_entry(good, sampling_entry({.temperature = 1.0f}, 0.5, true), out, 2);
  sample_entry(inf_row, sampling_entry({}), out, 3);
  sample_entry(all_masked, sampling_entry({}), out, 4);
  sample_entry(good, sampling_entry({.temperature = 1.0f}, 1.0), out, 5);  // uniform outside [0, 1)

  EXPECT_EQ(out.errors[1], "sampling: logit of token 3 is nan");
  EXPECT_EQ(out.errors[3], "sampling: logit of token 0 is inf");
  EXPECT_EQ(out.errors[4], "sampling: every logit is -inf");
  EXPECT_NE(out.errors[5].find("uniform"), std::string::npos) << out.errors[5];
  for (const size_t bad : {1u, 3u, 4u, 5u}) {
    EXPECT_EQ(out.tokens[bad], -1) << bad;
    EXPECT_TRUE(std::isnan(out.logprobs[bad])) << bad;
    EXPECT_EQ(out.errors[bad].find('\n'), std::string::npos) << "not one line: " << out.errors[bad];
  }
  for (const size_t ok : {0u, 2u}) {
    EXPECT_TRUE(out.errors[ok].empty()) << ok << ": " << out.errors[ok];
    EXPECT_GE(out.tokens[ok], 0);
    EXPECT_FALSE(std::isnan(out.logprobs[ok]));
  }
  EXPECT_EQ(out.tokens[2], sample_token_from_uniform(good, {.temperature = 1.0f}, 0.5));
}

TEST(StepModelSampleEntry, AnEntryOutsideTheOutputThrows) {
  StepOutput out = make_step_output(2);
  EXPECT_THROW(sample_entry(test_logits(), sampling_entry({}), out, 2), Error);
}

// The top of a row: descending, ties by lower id (4 before 11 at 9.5), -inf last, every value the same float as
// the token's own logprob; under greedy the sampled token heads it with its logprob.
TEST(StepModelSampleEntry, TopLogprobsAreSortedAndAgreeWithTheSampledToken) {
  const std::vector<float> logits = test_logits();
  StepSequence seq = sampling_entry({}, 0.0, true);
  seq.top_logprobs = 4;
  StepOutput out = make_step_output(1);
  sample_entry(logits, seq, out, 0);
  const TokenLogprob& top = out.top_logprobs[0];
  ASSERT_EQ(top.top_ids.size(), 4u);
  EXPECT_EQ(top.top_ids[0], out.tokens[0]);
  EXPECT_EQ(top.top_logprobs[0], out.logprobs[0]);
  EXPECT_EQ(top.top_ids[0], 4);
  EXPECT_EQ(top.top_ids[1], 11);
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(top.top_logprobs[k], token_logprob(logits, top.top_ids[k]));
    EXPECT_NEAR(top.top_logprobs[k], direct_logprob(logits, top.top_ids[k]), 1e-6);
    if (k > 0) {
      const float a = logits[static_cast<size_t>(top.top_ids[k - 1])], b = logits[static_cast<size_t>(top.top_ids[k])];
      EXPECT_TRUE(a > b || (a == b && top.top_ids[k - 1] < top.top_ids[k]));
    }
  }
  // N = vocabulary: every id once, the masked one last; N above the limit throws.
  const TokenLogprob all = token_logprob_with_top(std::vector<float>{0.0f, -INFINITY, 1.0f}, 0, 3);
  EXPECT_EQ(all.top_ids, (std::vector<int32_t>{2, 0, 1}));
  EXPECT_EQ(all.top_logprobs[2], -INFINITY);
  EXPECT_THROW(token_logprob_with_top(logits, 0, kMaxTopLogprobs + 1), Error);
  // No top asked: none reported.
  out = make_step_output(1);
  sample_entry(logits, sampling_entry({}, 0.0, true), out, 0);
  EXPECT_TRUE(out.top_logprobs[0].top_ids.empty());
}

// prompt_entry: one TokenLogprob per target, from its own row.
TEST(StepModelSampleEntry, PromptEntryScoresEachTargetOnItsRow) {
  const std::vector<float> a = test_logits();
  std::vector<float> b(a.rbegin(), a.rend());
  std::vector<float> rows = a;
  rows.insert(rows.end(), b.begin(), b.end());
  const std::vector<int32_t> targets = {11, 3};
  StepSequence seq;
  seq.prompt_targets = targets;
  seq.top_logprobs = 2;
  StepOutput out = make_step_output(1);
  prompt_entry(rows, seq, out, 0);
  ASSERT_EQ(out.prompt_logprobs[0].size(), 2u);
  EXPECT_EQ(out.prompt_logprobs[0][0].logprob, token_logprob(a, 11));
  EXPECT_EQ(out.prompt_logprobs[0][1].logprob, token_logprob(b, 3));
  EXPECT_EQ(out.prompt_logprobs[0][1].top_ids.size(), 2u);
  EXPECT_THROW(prompt_entry(std::span<const float>(rows).first(rows.size() - 1), seq, out, 0), Error);
}

}  // namespace
}  // namespace fulcrum::model
