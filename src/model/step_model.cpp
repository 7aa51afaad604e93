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
  out.errors.assign(num_entries, std::string());
  return out;
}

float token_logprob(std::span<const float> logits, int32_t token) {
  FULCRUM_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size(), "logprob: token {} outside [0, {})", token,
                logits.size());
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  FULCRUM_CHECK(std::isfinite(max_logit), "logprob: the largest logit is {}", max_logit);
  double sum = 0.0;
  for (const float v : logits) sum += std::exp(static_cast<double>(v) - max_logit);
  return static_cast<float>(static_cast<double>(logits[static_cast<size_t>(token)]) - max_logit - std::log(sum));
}

void sample_entry(std::span<const float> logits, const StepSequence& seq, StepOutput& out, size_t entry_idx) {
  FULCRUM_CHECK(entry_idx < out.tokens.size() && entry_idx < out.logprobs.size() && entry_idx < out.errors.size(),
                "sample_entry: entry {} outside an output of {} entries", entry_idx, out.tokens.size());
  if (!seq.sample) return;
  try {
    const int32_t token = sample_token_from_uniform(logits, seq.sampling, seq.uniform);
    if (seq.want_logprob) out.logprobs[entry_idx] = token_logprob(logits, token);
    out.tokens[entry_idx] = token;
  } catch (const std::exception& e) {  // this entry cannot sample; the others are unaffected
    out.errors[entry_idx] = e.what();
  }
}

}  // namespace fulcrum::model
