#pragma once
// Generation on the parallel engine, its ranks run as threads of this process (CPU backend), with the
// EPLB loop between forward passes. The decode loop itself is model::generate (one loop for every path).
#include <functional>
#include <memory>

#include "comm/communicator.hpp"
#include <string>
#include <vector>

#include "engine/engine_options.hpp"
#include "engine/parallel_layout.hpp"
#include "engine/rank_eplb.hpp"
#include "engine/rank_engine.hpp"
#include "model/generate.hpp"

namespace fulcrum::engine {

// One rank as a model::DecodeTarget: engine forward passes, then the EPLB step (when `eplb` is given).
class RankDecodeTarget final : public model::DecodeTarget {
 public:
  RankDecodeTarget(RankEngine& engine, RankEplb* eplb) : engine_(engine), eplb_(eplb) {}
  void reset(const std::vector<int64_t>& capacities) override { engine_.reset(capacities); }
  std::vector<model::HostTensor> forward(const std::vector<std::vector<int32_t>>& new_tokens) override;

 private:
  RankEngine& engine_;
  RankEplb* eplb_;
};

struct InProcessRun {
  std::string device = "cpu";  // each rank's backend (backend_factory.hpp)
  // --weight-cache DIR: each rank loads DIR/rank{r}.safetensors when present (no checkpoint reading), else
  // loads the checkpoint and writes that file (Qwen3MoeModel::save_weight_cache).
  std::string weight_cache_dir;
  std::string init_expert_location = "trivial";  // --init-expert-location (eplb_runtime/initial_placement.hpp)
  bool fp8_dense_gemms = false;  // --fp8-dense-gemms: the GPU engine's gpu::GpuEngineOptions::fp8_dense_gemms
  EngineOptions engine;
  bool record = false;        // count routing (implied by EPLB and by a dump)
  EplbSettings eplb;          // used when record; eplb.enabled: rebalance
  std::string dump_file;      // --expert-distribution-dump: the recorder's JSON, merged over ranks
  model::DecodeOptions decode;
  // Weight loading progress: called from each rank's thread after each of its layers, (world rank, layers
  // done, layers the rank owns); a weight-cache load reports all of them at once. Optional.
  std::function<void(int rank, int done, int total)> on_layer_loaded;
  // Optional, without a weight cache: which expert slots are read from the checkpoint (the others are the
  // caller's to write before the first pass: an elastic rebuild, rebuild_slots.hpp). Empty: every slot.
  model::Qwen3MoeModel::ExpertSlotFilter read_expert_slot;
};

struct InProcessResult {
  model::GenerateResult generated;  // world rank 0's (every rank has the same)
  eplb::Placement initial_placement;
  eplb::Placement final_placement;  // the live placement after the last pass
  std::vector<eplb_runtime::RebalanceReport> rebalances;
  eplb_runtime::MigrationStats migration;  // world rank 0's
  eplb::LoadMatrix window_loads;           // the recorder's window at the end, summed over ranks (when recording)
  std::string moe_row_path;                // world rank 0's MoE row exchange ("host" | "device"; empty: none)
  int64_t moe_row_collectives = 0;         // and the row collectives it made
};

// Checks `run` against the model and layout (EPLB settings; with run.eplb.enabled, a layout EPLB can run
// on, else throws: the caller decides whether to turn EPLB off and say so) and returns the placement the
// ranks start from (run.init_expert_location; empty for a model without MoE layers).
eplb::Placement prepare_in_process_run(const model::Qwen3MoeConfig& config, const ParallelLayout& layout,
                                       const InProcessRun& run);

// Whether `run` goes to the GPU engine's expert-parallel ranks (src/gpu/, threads of one process): --device cuda with
// W > 1 ranks that are each one attention data-parallel group and one EP rank in one stage (--tp W --dp W
// --enable-dp-attention --ep W). `generate` and `serve` both ask this.
bool runs_gpu_engine_ranks(const ParallelFlags& flags, const InProcessRun& run);
// Why those ranks cannot run `run` (empty: they can): a weight cache.
std::string why_gpu_engine_ranks_cannot_run(const InProcessRun& run);

// Whether the ranks count routing (run.record, EPLB or a dump asks for it, and the model has MoE layers).
bool records_routing(const model::Qwen3MoeConfig& config, const InProcessRun& run);

// One rank as generate_in_process builds it: its backend, its engine with weights loaded (from the weight
// cache when there is one), and its EPLB loop when recording.
struct InProcessRank {
  std::unique_ptr<model::Backend> backend;
  std::unique_ptr<RankEngine> engine;
  std::unique_ptr<RankEplb> eplb;  // null unless records_routing
};

// Collective over `world`. `config`, `layout` and `initial` must outlive the rank.
InProcessRank build_in_process_rank(const std::string& model_dir, const model::Qwen3MoeConfig& config,
                                    const ParallelLayout& layout, const InProcessRun& run,
                                    const eplb::Placement& initial, comm::Communicator& world);

// Loads `model_dir` on layout.world_size() in-process ranks (each reads only its slices) and generates.
// With run.eplb.enabled and a layout EPLB cannot run on (why_eplb_cannot_run), throws: the caller decides
// whether to turn EPLB off and say so.
InProcessResult generate_in_process(const std::string& model_dir, const model::Qwen3MoeConfig& config,
                                    const ParallelLayout& layout, const InProcessRun& run,
                                    const std::vector<std::vector<int32_t>>& prompts);

// generate_in_process in two halves, for runners that start the ranks elsewhere (multi_process_run.hpp):
// the checks and the initial placement (the same on every rank), then one rank's whole run, which fills
// `result` on world rank 0.
InProcessResult prepare_generate(const model::Qwen3MoeConfig& config, const ParallelLayout& layout,
                                 const InProcessRun& run);
void generate_on_rank(int rank, comm::Communicator& world, const std::string& model_dir,
                      const model::Qwen3MoeConfig& config, const ParallelLayout& layout, const InProcessRun& run,
                      const std::vector<std::vector<int32_t>>& prompts, InProcessResult& result);

}  // namespace fulcrum::engine
