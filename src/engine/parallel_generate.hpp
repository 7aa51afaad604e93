#pragma once
// Greedy decoding on the parallel engine, its ranks run as threads of this process (CPU backend).
#include <string>
#include <vector>

#include "engine/engine_options.hpp"
#include "engine/parallel_layout.hpp"
#include "engine/rank_engine.hpp"
#include "model/generate.hpp"

namespace fulcrum::engine {

// Greedy decoding on one rank (collective: every rank calls it with the same prompts). Same contract as
// model::generate_greedy: prompts prefilled in one batch, then one token per sequence per step.
model::GenerateResult generate_greedy(RankEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                      int max_new_tokens);

// Loads `model_dir` on layout.world_size() in-process ranks (each reads only its slices) and decodes;
// returns rank 0's result (every rank has the same). `placement`: null for the trivial placement.
model::GenerateResult generate_in_process(const std::string& model_dir, const model::Qwen3MoeConfig& config,
                                          const ParallelLayout& layout, const eplb::Placement* placement,
                                          const EngineOptions& options,
                                          const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens);

}  // namespace fulcrum::engine
