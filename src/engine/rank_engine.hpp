#pragma once
// One rank of the parallel engine: its shard of the model (one pipeline stage, one attention-DP group's
// heads, one EP rank's slots), its groups, and a forward pass over a global batch.
//
// Every rank of the world calls the same methods with the same arguments, in the same order (they are
// collective). forward() takes every sequence's new tokens; each rank runs the sequences of its attention
// DP group (ParallelLayout::dp_group_of_sequence), and every rank returns every sequence's logits.
#include <memory>
#include <vector>

#include "comm/communicator.hpp"
#include "engine/engine_options.hpp"
#include "engine/moe_exchange.hpp"
#include "engine/parallel_layout.hpp"
#include "eplb/placement.hpp"
#include "model/qwen3_moe.hpp"
#include "model/safetensors.hpp"

namespace fulcrum::engine {

class RankEngine {
 public:
  // `world`: all tp x pp ranks (rank = world rank). `placement`: every MoE layer of the model, P slots
  // (null: trivial); its topology is set to {P, ep, 1}. Builds the groups with Communicator::split (the
  // stage's tp group, which is also the MoE exchange group, the attention TP group and the pipeline group)
  // and the model shard (no weight read). config, layout, world and backend must outlive the engine.
  RankEngine(const model::Qwen3MoeConfig& config, const ParallelLayout& layout, comm::Communicator& world,
             model::Backend& backend, const eplb::Placement* placement, EngineOptions options);
  ~RankEngine();
  RankEngine(const RankEngine&) = delete;
  RankEngine& operator=(const RankEngine&) = delete;

  const RankCoords& coords() const { return coords_; }
  const ParallelLayout& layout() const { return layout_; }
  model::Qwen3MoeModel& model() { return *model_; }
  const TokenDispatcher* dispatcher() const { return ops_ ? &ops_->dispatcher() : nullptr; }

  // Replaces the routing hook (between forward passes): how the EPLB recorder attaches to a built engine.
  void set_routing_hook(RoutingHook hook) { options_.on_routing = std::move(hook); }

  // Reads this rank's slices of the weights.
  void load_weights(model::Checkpoint& checkpoint);

  // Forgets every sequence and makes room for sequences of the given capacities (positions).
  void reset(const std::vector<int64_t>& capacities);
  // new_tokens[i]: sequence i's new tokens (may be empty) -> logits [num_new_tokens, vocab_size] per sequence.
  std::vector<model::HostTensor> forward(const std::vector<std::vector<int32_t>>& new_tokens);

  // Replaces MoE layer `moe_layer_idx`'s slot map between forward passes (every rank, the same map):
  // ranks whose stage owns it re-read their changed slots from `checkpoint`; the others have nothing to do.
  void replace_layer_placement(int moe_layer_idx, std::span<const int32_t> layer_map, model::Checkpoint& checkpoint);
  // The same switch when the caller has already written this rank's changed slots (model().expert_slot_views(),
  // e.g. a migration from peers): only the map changes. Replica choice follows the new map on the next pass.
  void commit_layer_placement(int moe_layer_idx, std::span<const int32_t> layer_map);

 private:
  const model::Qwen3MoeConfig& config_;
  const ParallelLayout& layout_;
  RankCoords coords_;
  model::Backend& backend_;
  EngineOptions options_;
  std::unique_ptr<comm::Communicator> stage_, attn_tp_, pp_;
  std::unique_ptr<StageParallelOps> ops_;
  std::unique_ptr<model::Qwen3MoeModel> model_;
  std::vector<int> my_sequences_;          // indices of the sequences of this rank's attention-DP group
  int owned_moe_layer(int moe_layer_idx) const;  // decoder index, or -1 when another stage owns it

  std::vector<model::KvCache> caches_;     // [my_sequences_.size()]
  int num_sequences_ = 0;
  uint64_t pass_idx_ = 0;
};

}  // namespace fulcrum::engine
