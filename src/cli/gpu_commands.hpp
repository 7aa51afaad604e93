#pragma once
// The CLI's GPU-engine halves (gpu_*.cpp, CUDA builds only): `generate --device cuda` on one GPU and
// `bench generate`. Callers guard them with FULCRUM_WITH_CUDA.
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "engine/parallel_generate.hpp"

namespace fulcrum::cli {

// `generate` on the GPU engine: one rank of layout (tp = ep = pp = 1), prints what the engine path prints.
void generate_on_gpu(const std::string& model_dir, const model::Qwen3MoeConfig& config,
                     const engine::ParallelLayout& layout, const engine::InProcessRun& run,
                     const std::vector<std::vector<int32_t>>& prompts, const std::string& dump_logits_file);

// `generate` on W GPU engines in lockstep (engine::runs_gpu_engine_ranks), threads of this process (rank r on GPU r % visible GPUs, prompt i on
// rank i % W; gpu::GpuEngineOptions::ep over comm::HostStagedExchange). The same output as generate_on_gpu.
void generate_on_gpu_ranks(const std::string& model_dir, const model::Qwen3MoeConfig& config,
                           const engine::ParallelLayout& layout, const engine::InProcessRun& run,
                           const std::vector<std::vector<int32_t>>& prompts, const std::string& dump_logits_file);

void register_bench_generate_command(CLI::App& bench);

}  // namespace fulcrum::cli
