#include "model/generate.hpp"

#include <algorithm>
#include <string>

#include "eplb/error.hpp"

namespace fulcrum::model {
namespace {

// The single-rank model as a DecodeTarget.
class ModelDecodeTarget final : public DecodeTarget {
 public:
  ModelDecodeTarget(Qwen3MoeModel& model, Backend& backend, const ForwardHooks& hooks)
      : model_(model), backend_(backend), hooks_(hooks) {}

  void reset(const std::vector<int64_t>& capacities) override {
    caches_.clear();
    for (const int64_t capacity : capacities) caches_.push_back(model_.create_kv_cache(capacity));
  }

  std::vector<HostTensor> forward(const std::vector<std::vector<int32_t>>& new_tokens) override {
    FULCRUM_CHECK(new_tokens.size() == caches_.size(), "forward: {} sequences, reset() made room for {}",
                  new_tokens.size(), caches_.size());
    std::vector<SequenceInput> batch;
    for (size_t i = 0; i < new_tokens.size(); ++i) batch.push_back(SequenceInput{new_tokens[i], &caches_[i]});
    std::vector<HostTensor> out;
    for (const Tensor& logits : model_.forward(batch, hooks_)) out.push_back({logits.shape(), backend_.download(logits)});
    return out;
  }

 private:
  Qwen3MoeModel& model_;
  Backend& backend_;
  const ForwardHooks& hooks_;
  std::vector<KvCache> caches_;
};

}  // namespace

int32_t argmax(std::span<const float> values) {
  FULCRUM_CHECK(!values.empty(), "argmax of an empty row");
  size_t best = 0;
  for (size_t i = 1; i < values.size(); ++i) {
    if (values[i] > values[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

GenerateResult generate(DecodeTarget& target, const std::vector<std::vector<int32_t>>& prompts,
                        const DecodeOptions& options) {
  FULCRUM_CHECK(options.max_new_tokens >= 0, "max_new_tokens must not be negative, got {}", options.max_new_tokens);
  validate_sampling_params(options.sampling);
  std::vector<int64_t> capacities;
  std::vector<Rng> rngs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    FULCRUM_CHECK(!prompts[i].empty(), "prompt {} is empty", i);
    capacities.push_back(static_cast<int64_t>(prompts[i].size()) + std::max(options.max_new_tokens, 1));
    rngs.emplace_back(options.seed, "sequence " + std::to_string(i));
  }
  target.reset(capacities);
  GenerateResult result;
  result.new_tokens.resize(prompts.size());
  result.prompt_logits = target.forward(prompts);  // per sequence [prompt_len, vocab_size]
  std::vector<std::vector<int32_t>> next(prompts.size());  // one token per sequence
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto& logits = result.prompt_logits[i];
    const auto vocab_size = static_cast<size_t>(logits.shape.back());
    next[i] = {sample_token(std::span<const float>(logits.data).last(vocab_size), options.sampling, rngs[i])};
  }
  for (int step = 0; step < options.max_new_tokens; ++step) {
    for (size_t i = 0; i < prompts.size(); ++i) result.new_tokens[i].push_back(next[i][0]);
    if (step + 1 == options.max_new_tokens) break;
    const std::vector<HostTensor> logits = target.forward(next);  // per sequence [1, vocab_size]
    for (size_t i = 0; i < prompts.size(); ++i) next[i] = {sample_token(logits[i].data, options.sampling, rngs[i])};
  }
  return result;
}

GenerateResult generate_greedy(Qwen3MoeModel& model, Backend& backend, const std::vector<std::vector<int32_t>>& prompts,
                               int max_new_tokens, const ForwardHooks& hooks) {
  ModelDecodeTarget target(model, backend, hooks);
  DecodeOptions options;
  options.max_new_tokens = max_new_tokens;
  return generate(target, prompts, options);
}

}  // namespace fulcrum::model
