#include "engine/parallel_generate.hpp"

#include <algorithm>
#include <mutex>

#include "backend/cpu/cpu_backend.hpp"
#include "comm/in_process_communicator.hpp"
#include "eplb/error.hpp"

namespace fulcrum::engine {

model::GenerateResult generate_greedy(RankEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                      int max_new_tokens) {
  FULCRUM_CHECK(max_new_tokens >= 0, "max_new_tokens must not be negative, got {}", max_new_tokens);
  std::vector<int64_t> capacities;
  for (size_t i = 0; i < prompts.size(); ++i) {
    FULCRUM_CHECK(!prompts[i].empty(), "prompt {} is empty", i);
    capacities.push_back(static_cast<int64_t>(prompts[i].size()) + std::max(max_new_tokens, 1));
  }
  engine.reset(capacities);
  model::GenerateResult result;
  result.new_tokens.resize(prompts.size());
  result.prompt_logits = engine.forward(prompts);  // per sequence [prompt_len, vocab_size]
  const auto vocab_size = static_cast<size_t>(engine.model().config().vocab_size);
  std::vector<std::vector<int32_t>> next(prompts.size());  // one token per sequence
  for (size_t i = 0; i < prompts.size(); ++i) {
    next[i] = {model::argmax(std::span<const float>(result.prompt_logits[i].data).last(vocab_size))};
  }
  for (int step = 0; step < max_new_tokens; ++step) {
    for (size_t i = 0; i < prompts.size(); ++i) result.new_tokens[i].push_back(next[i][0]);
    if (step + 1 == max_new_tokens) break;
    const std::vector<model::HostTensor> logits = engine.forward(next);  // per sequence [1, vocab_size]
    for (size_t i = 0; i < prompts.size(); ++i) next[i] = {model::argmax(logits[i].data)};
  }
  return result;
}

model::GenerateResult generate_in_process(const std::string& model_dir, const model::Qwen3MoeConfig& config,
                                          const ParallelLayout& layout, const eplb::Placement* placement,
                                          const EngineOptions& options,
                                          const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens) {
  model::GenerateResult result;
  comm::run_in_process(layout.world_size(), [&](int rank, comm::Communicator& world) {
    backend::CpuBackend backend;
    RankEngine engine(config, layout, world, backend, placement, options);
    model::Checkpoint checkpoint(model_dir);
    engine.load_weights(checkpoint);
    model::GenerateResult mine = generate_greedy(engine, prompts, max_new_tokens);
    if (rank == 0) result = std::move(mine);
  });
  return result;
}

}  // namespace fulcrum::engine
