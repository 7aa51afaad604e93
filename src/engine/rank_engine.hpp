#pragma once
// One rank of the parallel engine: its shard of the model (one pipeline stage, one attention-DP group's
// heads, one EP rank's slots), its groups, and a forward pass over a global batch.
//
// Every rank of the world calls the same methods with the same arguments, in the same order (they are
// collective). Sequences are added and dropped by id between forward passes; each belongs to one attention
// DP group for its life (the group with the fewest live sequences when it was added, the lowest on ties:
// every rank derives the same group). forward() takes new tokens of any live sequences; each rank runs the
// sequences of its DP group, and every rank returns every entry's logits.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "comm/communicator.hpp"
#include "engine/engine_options.hpp"
#include "engine/moe_exchange.hpp"
#include "engine/parallel_layout.hpp"
#include "eplb/placement.hpp"
#include "model/qwen3_moe.hpp"
#include "model/safetensors.hpp"

namespace fulcrum::engine {

using SequenceId = int64_t;

// One entry of a forward pass: the new tokens of a live sequence (may be empty), after what its cache holds.
struct SequenceTokens {
  SequenceId id = 0;
  std::span<const int32_t> token_ids;
  int64_t num_last_rows = 1;  // with LogitRows::kLast: logits of its last min(this, new tokens) positions
                              // (more than 1 for prompt logprobs); >= 1
};

// Which logits forward() returns per entry: every new position, or only the last ones (what a decode
// step samples from; the LM head then runs on one row per sequence but for entries that ask more).
enum class LogitRows { kAll, kLast };

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
  const RoutingHook& routing_hook() const { return options_.on_routing; }

  // Reads this rank's slices of the weights.
  void load_weights(model::Checkpoint& checkpoint);

  // Adds sequence `id` (not live) with room for `capacity` positions; returns its attention-DP group
  // (`dp_group`, or with -1 the one with the fewest live sequences). Only the ranks of that group allocate
  // its KV cache from their pool (Qwen3MoeModel::create_kv_cache).
  int add_sequence(SequenceId id, int64_t capacity, int dp_group = -1);
  // Adds sequence `id` to attention-DP group `dp_group` over pages the caller chose (Qwen3MoeModel::
  // map_kv_cache; positions [0, num_cached_tokens) already filled, the last partial page's rows copied from
  // copy_source_page when >= 0): the server's prefix cache picks them.
  void add_sequence_on_pages(SequenceId id, int64_t capacity, int dp_group, std::span<const int32_t> page_ids,
                             int64_t num_cached_tokens, int32_t copy_source_page = -1);
  // Drops sequence `id` and frees its cache; a no-op when it is not live.
  void drop_sequence(SequenceId id);

  // Entries of live sequences, each at most once -> logits per entry in batch order: [num_new_tokens,
  // vocab_size] (kAll) or [min(num_last_rows, new tokens), vocab_size] (kLast; entries with no new token
  // then get [0, vocab_size]).
  std::vector<model::HostTensor> forward(std::span<const SequenceTokens> batch, LogitRows rows = LogitRows::kAll);

  // The fixed-batch form model::generate drives: drops every sequence and adds sequences 0..n-1 (so
  // sequence i is in DP group i % D); forward(new_tokens) runs new_tokens[i] on sequence i.
  void reset(const std::vector<int64_t>& capacities);
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
  int owned_moe_layer(int moe_layer_idx) const;  // decoder index, or -1 when another stage owns it

  struct LiveSequence {
    int dp_group = 0;
    std::optional<model::KvCache> cache;  // only on ranks of its DP group
  };
  std::map<SequenceId, LiveSequence> live_;  // every live sequence of the world
  std::vector<int> group_sizes_;             // [attn_dp_size]: live sequences per DP group
  uint64_t pass_idx_ = 0;
};

}  // namespace fulcrum::engine
