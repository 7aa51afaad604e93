#include "model/step_model.hpp"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>

#include "eplb/error.hpp"

namespace fulcrum::model {

StepOutput make_step_output(size_t num_entries) {
  StepOutput out;
  out.tokens.assign(num_entries, -1);
  out.logprobs.assign(num_entries, std::numeric_limits<float>::quiet_NaN());
  out.top_logprobs.assign(num_entries, TokenLogprob{});
  out.prompt_logprobs.assign(num_entries, std::vector<TokenLogprob>());
  out.errors.assign(num_entries, std::string());
  return out;
}

namespace {

// max and log(sum exp(logit - max)) of a row: the one normalizer every logprob of the row uses.
struct LogNormalizer {
  double max_logit = 0.0, log_sum = 0.0;
  float of(float logit) const { return static_cast<float>(static_cast<double>(logit) - max_logit - log_sum); }
};

LogNormalizer log_normalizer(std::span<const float> logits) {
  FULCRUM_CHECK(!logits.empty(), "logprob: an empty row of logits");
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  FULCRUM_CHECK(std::isfinite(max_logit), "logprob: the largest logit is {}", max_logit);
  double sum = 0.0;
  for (const float v : logits) sum += std::exp(static_cast<double>(v) - max_logit);
  return {max_logit, std::log(sum)};
}

}  // namespace

float token_logprob(std::span<const float> logits, int32_t token) {
  FULCRUM_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size(), "logprob: token {} outside [0, {})", token,
                logits.size());
  return log_normalizer(logits).of(logits[static_cast<size_t>(token)]);
}

TokenLogprob token_logprob_with_top(std::span<const float> logits, int32_t token, int num_top) {
  FULCRUM_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size(), "logprob: token {} outside [0, {})", token,
                logits.size());
  FULCRUM_CHECK(num_top >= 0 && num_top <= kMaxTopLogprobs, "logprob: top {} outside [0, {}]", num_top, kMaxTopLogprobs);
  const LogNormalizer norm = log_normalizer(logits);
  TokenLogprob out;
  out.logprob = norm.of(logits[static_cast<size_t>(token)]);
  const size_t k = std::min(static_cast<size_t>(num_top), logits.size());
  if (k == 0) return out;
  // The k first in (logit descending, id ascending): a bounded selection, then sorted.
  const auto before = [&](int32_t a, int32_t b) {
    const float la = logits[static_cast<size_t>(a)], lb = logits[static_cast<size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
  std::vector<int32_t> best;  // sorted by `before`, at most k
  best.reserve(k + 1);
  for (int32_t id = 0; id < static_cast<int32_t>(logits.size()); ++id) {
    if (best.size() == k && !before(id, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), id, before), id);
    if (best.size() > k) best.pop_back();
  }
  out.top_ids = best;
  for (const int32_t id : best) out.top_logprobs.push_back(norm.of(logits[static_cast<size_t>(id)]));
  return out;
}

void prompt_entry(std::span<const float> rows, const StepSequence& seq, StepOutput& out, size_t entry_idx) {
  FULCRUM_CHECK(entry_idx < out.prompt_logprobs.size(), "prompt_entry: entry {} outside an output of {} entries",
                entry_idx, out.prompt_logprobs.size());
  const size_t num_rows = seq.prompt_targets.size();
  if (num_rows == 0) return;
  FULCRUM_CHECK(rows.size() % num_rows == 0, "prompt_entry: {} logits for {} rows", rows.size(), num_rows);
  const size_t vocab = rows.size() / num_rows;
  std::vector<TokenLogprob>& dst = out.prompt_logprobs[entry_idx];
  dst.clear();
  for (size_t j = 0; j < num_rows; ++j) {
    dst.push_back(token_logprob_with_top(rows.subspan(j * vocab, vocab), seq.prompt_targets[j], seq.top_logprobs));
  }
}

void sample_entry(std::span<const float> logits, const StepSequence& seq, StepOutput& out, size_t entry_idx) {
  FULCRUM_CHECK(entry_idx < out.tokens.size() && entry_idx < out.logprobs.size() && entry_idx < out.errors.size(),
                "sample_entry: entry {} outside an output of {} entries", entry_idx, out.tokens.size());
  if (!seq.sample) return;
  try {
    const int32_t token = sample_token_from_uniform(logits, seq.sampling, seq.uniform);
    if (seq.want_logprob) {
      TokenLogprob lp = token_logprob_with_top(logits, token, seq.top_logprobs);
      out.logprobs[entry_idx] = lp.logprob;
      if (entry_idx < out.top_logprobs.size()) out.top_logprobs[entry_idx] = std::move(lp);
    }
    out.tokens[entry_idx] = token;
  } catch (const std::exception& e) {  // this entry cannot sample; the others are unaffected
    out.errors[entry_idx] = e.what();
  }
}

}  // namespace fulcrum::model
