#include "model/generate.hpp"

#include "eplb/error.hpp"

namespace fulcrum::model {

int32_t argmax(std::span<const float> values) {
  FULCRUM_CHECK(!values.empty(), "argmax of an empty row");
  size_t best = 0;
  for (size_t i = 1; i < values.size(); ++i) {
    if (values[i] > values[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

GenerateResult generate_greedy(Qwen3MoeModel& model, Backend& backend, const std::vector<std::vector<int32_t>>& prompts,
                               int max_new_tokens, const ForwardHooks& hooks) {
  FULCRUM_CHECK(max_new_tokens >= 0, "max_new_tokens must not be negative, got {}", max_new_tokens);
  const int64_t vocab_size = model.config().vocab_size;
  std::vector<KvCache> caches;
  for (size_t i = 0; i < prompts.size(); ++i) {
    FULCRUM_CHECK(!prompts[i].empty(), "prompt {} is empty", i);
    caches.push_back(model.create_kv_cache(static_cast<int64_t>(prompts[i].size()) + std::max(max_new_tokens, 1)));
  }
  GenerateResult result;
  result.new_tokens.resize(prompts.size());
  std::vector<SequenceInput> batch;
  for (size_t i = 0; i < prompts.size(); ++i) batch.push_back(SequenceInput{prompts[i], &caches[i]});
  std::vector<Tensor> logits = model.forward(batch, hooks);  // per sequence [prompt_len, vocab_size]
  std::vector<int32_t> next(prompts.size());                 // [num_sequences]
  for (size_t i = 0; i < prompts.size(); ++i) {
    HostTensor host{logits[i].shape(), backend.download(logits[i])};
    next[i] = argmax(std::span<const float>(host.data).last(static_cast<size_t>(vocab_size)));
    result.prompt_logits.push_back(std::move(host));
  }
  for (int step = 0; step < max_new_tokens; ++step) {
    for (size_t i = 0; i < prompts.size(); ++i) result.new_tokens[i].push_back(next[i]);
    if (step + 1 == max_new_tokens) break;
    batch.clear();
    for (size_t i = 0; i < prompts.size(); ++i) batch.push_back(SequenceInput{std::span<const int32_t>(&next[i], 1), &caches[i]});
    logits = model.forward(batch, hooks);  // per sequence [1, vocab_size]
    for (size_t i = 0; i < prompts.size(); ++i) next[i] = argmax(backend.download(logits[i]));
  }
  return result;
}

}  // namespace fulcrum::model
