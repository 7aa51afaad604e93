#pragma once
// Qwen3-MoE decoder, written once against model::Backend. One object is one pipeline stage: it owns
// decoder layers [start_layer, end_layer); layers outside the range do not exist here (no weights, no
// expert slots, no descriptors). The first stage also owns the embedding, the last the final norm and
// LM head.
//
// Routed experts live in PHYSICAL SLOTS. Each MoE layer holds
//   gate_up [num_slots, 2 * moe_intermediate_size, hidden_size]  (rows [0, I): gate_proj, [I, 2I): up_proj)
//   down    [num_slots, hidden_size, moe_intermediate_size]
// and a physical_to_logical map [num_slots] (one layer of an eplb::Placement). Loading fills every slot
// from the checkpoint tensors of the logical expert it holds; replication and migration write slots.
// The descriptors of these tensors (expert_slot_views) exist from construction, before any weight is
// read: they are the one contract through which EPLB records, plans and migrates.
//
// NOTES: on one rank, a token routed to logical expert e is computed once, by e's FIRST replica (lowest
// slot index); with a ModelParallel, the engine (ParallelOps::moe_experts) chooses replicas and exchanges
// tokens. Per-token outputs are combined in ascending logical-expert order (as HF's expert loop does), so
// logits do not depend on the placement at all.
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <memory>
#include <span>
#include <vector>

#include "eplb/placement.hpp"
#include "model/backend.hpp"
#include "model/kv_pool.hpp"
#include "model/model_parallel.hpp"
#include "model/qwen3_config.hpp"
#include "model/safetensors.hpp"

namespace fulcrum::model {

struct StageRange {
  int start_layer = 0;
  int end_layer = -1;  // exclusive; -1: through the last layer
};

// The expert-slot tensors of one MoE layer this stage owns, as held by this rank. With expert parallelism
// a rank holds the global slots [slot_begin, slot_begin + num_slots) of the layer's num_physical_experts,
// each sliced to w = moe_intermediate_size / moe_tp_size columns of the intermediate dimension.
struct ExpertSlotView {
  int layer_idx = 0;        // decoder layer index
  int moe_layer_idx = 0;    // ordinal among all MoE layers of the model: the row of an eplb::Placement
  int num_slots = 0;        // physical slots on this rank
  int slot_begin = 0;       // global index of local slot 0
  int num_physical_experts = 0;  // slots of the layer over all EP ranks
  int num_logical_experts = 0;
  Tensor gate_up;           // [num_slots, 2 * w, hidden_size]
  Tensor down;              // [num_slots, hidden_size, w]
  std::span<int32_t> physical_to_logical;  // [num_slots]: this rank's part of layer_map; write it with its slots
  std::span<const int32_t> layer_map;      // [num_physical_experts]: the whole layer (every rank keeps a copy)
};

// One sequence of a batch: new tokens, appended after what its cache already holds.
struct SequenceInput {
  std::span<const int32_t> token_ids;
  KvCache* cache = nullptr;
};

struct ForwardHooks {
  // Called per owned MoE layer with router logits [num_tokens, num_experts] (all sequences' tokens in
  // batch order) and the routing decision.
  std::function<void(int layer_idx, const Tensor& router_logits, const RouterChoice& choice)> on_router;
};

class Qwen3MoeModel {
 public:
  // `placement` (optional) gives the physical slots of every MoE layer of the model; without it the
  // trivial placement (num_slots = num_experts, slot s holds expert s, one GPU) is used. `parallel`
  // (optional) makes this object one rank's shard (see model_parallel.hpp). The backend must outlive the
  // model. Slot tensors are allocated (zeroed) here; no weight is read.
  Qwen3MoeModel(const Qwen3MoeConfig& config, Backend& backend, StageRange stage = {},
                const eplb::Placement* placement = nullptr, const ModelParallel& parallel = {});
  ~Qwen3MoeModel();
  Qwen3MoeModel(const Qwen3MoeModel&) = delete;
  Qwen3MoeModel& operator=(const Qwen3MoeModel&) = delete;

  const Qwen3MoeConfig& config() const { return config_; }
  int start_layer() const { return start_layer_; }
  int end_layer() const { return end_layer_; }
  bool owns_layer(int layer_idx) const { return layer_idx >= start_layer_ && layer_idx < end_layer_; }
  bool is_first_stage() const { return start_layer_ == 0; }
  bool is_last_stage() const { return end_layer_ == config_.num_hidden_layers; }

  const ShardSpec& shard() const { return parallel_.shard; }
  int num_local_heads() const { return config_.num_attention_heads / parallel_.shard.attn_tp_size; }
  int num_local_kv_heads() const;

  // One view per owned MoE layer, ascending layer index. Valid from construction on.
  std::vector<ExpertSlotView> expert_slot_views();

  // Replaces the slot map of owned MoE layer `layer_idx` (decoder index) by `layer_map` [num_physical_experts]
  // between forward passes: slots of this rank whose logical expert changes are re-read from `checkpoint`
  // (only this rank's slice), then the map is switched. Every rank must pass the same map.
  void replace_layer_map(int layer_idx, std::span<const int32_t> layer_map, Checkpoint& checkpoint);
  // Switches the map only: the caller has already written this rank's changed slots (expert_slot_views),
  // e.g. by migrating them from peers. Validated like replace_layer_map.
  void set_layer_map(int layer_idx, std::span<const int32_t> layer_map);

  // Reads this stage's weights. Every expected tensor must be present with its exact shape; a tensor
  // that belongs to no layer of this model is an error; tensors of other stages' layers are skipped.
  // With tie_word_embeddings, a stored lm_head.weight is accepted and ignored.
  // `on_layer` (optional) is called after each owned layer with (layers done, owned layers): a progress bar.
  // `read_expert_slot` (optional): (MoE layer, local slot) -> whether that slot is read here; a slot it
  // refuses is left for the caller to write (an elastic rebuild copies it from a surviving replica).
  using ExpertSlotFilter = std::function<bool(int moe_layer_idx, int local_slot)>;
  void load_weights(Checkpoint& checkpoint, const std::function<void(int done, int total)>& on_layer = {},
                    const ExpertSlotFilter& read_expert_slot = {});

  // The weight cache (weight_cache.cpp): every tensor this stage and rank holds, in its own layout (expert
  // slots as placed), in one safetensors file, so a restart skips per-tensor checkpoint loading. Loading
  // it fills the same tensors the expert-slot views describe (they exist from construction either way);
  // the file must have been written for this config, stage, shard and placement, else a one-line error.
  void save_weight_cache(const std::string& path);
  void load_weight_cache(const std::string& path);

  // A sequence's cache of `capacity` positions for this stage's layers: pages of this model's KvPool
  // (kv_pool.hpp), returned when the cache goes. Without reserve_kv_pool the pool grows as needed; after
  // it, a request beyond the free pages throws "KV pool exhausted: need N pages, M free".
  KvCache create_kv_cache(int64_t capacity);
  // A cache over pages the caller chose (KvPool::map_cache: the server's prefix cache shares pages).
  KvCache map_kv_cache(std::span<const int32_t> page_ids, int64_t capacity, int64_t num_cached_tokens,
                       int32_t copy_source_page = -1) {
    return kv_pool_->map_cache(page_ids, capacity, num_cached_tokens, copy_source_page);
  }
  // Fixes the pool at `num_pages` pages of `page_size` positions, allocated now; no cache may be alive.
  void reserve_kv_pool(int64_t num_pages, int64_t page_size);
  const KvPool& kv_pool() const { return *kv_pool_; }  // page counts, page size, bytes

  // Whole-model step (the stage must own every layer): logits [num_new_tokens, vocab_size] per sequence.
  std::vector<Tensor> forward(std::span<const SequenceInput> batch, const ForwardHooks& hooks = {});

  // Stage pieces. embed: first stage only. run_layers: hidden [num_tokens, hidden_size] through the owned
  // layers (advances no cache counter; see commit_tokens). lm_head: last stage only.
  Tensor embed(std::span<const SequenceInput> batch);
  Tensor run_layers(const Tensor& hidden, std::span<const SequenceInput> batch, const ForwardHooks& hooks = {});
  Tensor lm_head(const Tensor& hidden);
  static void commit_tokens(std::span<const SequenceInput> batch);

 private:
  struct Layer;

  Tensor attention_block(Layer& layer, size_t local_idx, const Tensor& x, std::span<const SequenceInput> batch,
                         std::span<const int32_t> positions);
  Tensor moe_block(Layer& layer, const Tensor& x, const ForwardHooks& hooks);
  Tensor dense_mlp_block(Layer& layer, const Tensor& x);
  void load_layer(Layer& layer, Checkpoint& checkpoint, const ExpertSlotFilter& read_expert_slot);
  void load_expert_slot(Layer& layer, Checkpoint& checkpoint, int local_slot, int expert_idx);
  ExpertSlotView slot_view(Layer& layer);
  std::vector<std::pair<std::string, Tensor>> named_tensors();  // weight cache names of every held tensor
  std::map<std::string, std::string> weight_cache_identity();   // what a cache must match to be loaded
  Layer& checked_moe_layer(int layer_idx, std::span<const int32_t> layer_map);

  Qwen3MoeConfig config_;
  Backend& backend_;
  ModelParallel parallel_;
  int start_layer_ = 0;
  int end_layer_ = 0;
  std::vector<std::unique_ptr<Layer>> layers_;  // [end_layer - start_layer]
  Tensor embed_tokens_;                          // [vocab_size, hidden_size], first stage
  Tensor norm_;                                  // [hidden_size], last stage
  Tensor lm_head_;                               // [vocab_size, hidden_size], last stage (the embedding when tied)
  std::shared_ptr<KvPool> kv_pool_;              // K/V pages of the owned layers; caches hold weak references
};

}  // namespace fulcrum::model
