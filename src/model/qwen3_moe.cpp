#include "model/qwen3_moe.hpp"

#include <algorithm>
#include <numeric>

#include "eplb/error.hpp"
#include "model/qwen3_moe_layer.hpp"

namespace fulcrum::model {

namespace {

// Checks that `shard` divides this config evenly (the engine's layout refuses such layouts earlier, with flags).
void check_shard(const Qwen3MoeConfig& config, const ShardSpec& shard, int num_physical_experts) {
  const int a = shard.attn_tp_size;
  FULCRUM_CHECK(a >= 1 && shard.attn_tp_rank >= 0 && shard.attn_tp_rank < a, "attention TP rank {} of {}",
                shard.attn_tp_rank, a);
  FULCRUM_CHECK(config.num_attention_heads % a == 0, "num_attention_heads {} is not divisible by attention TP size {}",
                config.num_attention_heads, a);
  const int kv = config.num_key_value_heads;
  FULCRUM_CHECK(kv >= a ? kv % a == 0 : a % kv == 0,
                "num_key_value_heads {} can be neither sharded nor evenly replicated over attention TP size {}", kv, a);
  FULCRUM_CHECK(shard.ep_size >= 1 && shard.ep_rank >= 0 && shard.ep_rank < shard.ep_size &&
                    shard.moe_tp_size >= 1 && shard.moe_tp_rank >= 0 && shard.moe_tp_rank < shard.moe_tp_size,
                "EP rank {} of {}, expert TP rank {} of {}", shard.ep_rank, shard.ep_size, shard.moe_tp_rank,
                shard.moe_tp_size);
  if (!config.moe_layer_indices().empty()) {
    FULCRUM_CHECK(num_physical_experts % shard.ep_size == 0, "{} physical experts are not divisible by EP size {}",
                  num_physical_experts, shard.ep_size);
    FULCRUM_CHECK(config.moe_intermediate_size % shard.moe_tp_size == 0,
                  "moe_intermediate_size {} is not divisible by {} ranks per EP rank", config.moe_intermediate_size,
                  shard.moe_tp_size);
  }
  if (config.moe_layer_indices().size() < static_cast<size_t>(config.num_hidden_layers)) {
    FULCRUM_CHECK(config.intermediate_size % a == 0, "intermediate_size {} is not divisible by attention TP size {}",
                  config.intermediate_size, a);
  }
}

}  // namespace

Tensor expert_mlp(Backend& backend, const Tensor& xs, const Tensor& gate_up, const Tensor& down) {
  const Tensor h = backend.matmul(xs, gate_up);  // [n, 2w]
  const Tensor act = backend.silu_mul(h);        // [n, w]
  return backend.matmul(act, down);              // [n, hidden_size]
}

int Qwen3MoeModel::num_local_kv_heads() const {
  return std::max(1, config_.num_key_value_heads / parallel_.shard.attn_tp_size);
}

Qwen3MoeModel::Qwen3MoeModel(const Qwen3MoeConfig& config, Backend& backend, StageRange stage,
                             const eplb::Placement* placement, const ModelParallel& parallel)
    : config_(config), backend_(backend), parallel_(parallel) {
  start_layer_ = stage.start_layer;
  end_layer_ = stage.end_layer < 0 ? config.num_hidden_layers : stage.end_layer;
  FULCRUM_CHECK(start_layer_ >= 0 && start_layer_ < end_layer_ && end_layer_ <= config.num_hidden_layers,
                "stage layers [{}, {}) are not a non-empty range of the model's {} layers", start_layer_, end_layer_,
                config.num_hidden_layers);

  const int num_moe_layers = static_cast<int>(config.moe_layer_indices().size());
  eplb::Placement trivial;
  if (placement == nullptr && num_moe_layers > 0) {
    trivial = eplb::trivial_placement(eplb::Topology{config.num_experts, 1, 1}, num_moe_layers, config.num_experts);
    placement = &trivial;
  }
  if (placement != nullptr && num_moe_layers > 0) {
    FULCRUM_CHECK(placement->num_layers == num_moe_layers && placement->num_logical_experts == config.num_experts,
                  "placement covers {} MoE layers of {} experts, the model has {} MoE layers of {} experts",
                  placement->num_layers, placement->num_logical_experts, num_moe_layers, config.num_experts);
    placement->validate();
  }
  const ShardSpec& shard = parallel_.shard;
  check_shard(config, shard, placement != nullptr ? placement->num_physical_experts() : 0);
  FULCRUM_CHECK(parallel_.ops != nullptr || (shard.attn_tp_size == 1 && shard.ep_size == 1 && shard.moe_tp_size == 1),
                "a sharded model needs ParallelOps");

  const int64_t hidden = config.hidden_size, head_dim = config.head_dim;
  const int64_t q_width = int64_t{num_local_heads()} * head_dim;       // this rank's query heads
  const int64_t kv_width = int64_t{num_local_kv_heads()} * head_dim;   // this rank's kv heads
  const int64_t mlp_width = config.intermediate_size / shard.attn_tp_size;
  for (int layer_idx = start_layer_; layer_idx < end_layer_; ++layer_idx) {
    auto layer = std::make_unique<Layer>();
    layer->layer_idx = layer_idx;
    layer->moe_layer_idx = config.moe_layer_ordinal(layer_idx);
    layer->input_layernorm = backend_.zeros({hidden});
    layer->post_attention_layernorm = backend_.zeros({hidden});
    layer->q_proj = backend_.zeros({q_width, hidden});
    layer->k_proj = backend_.zeros({kv_width, hidden});
    layer->v_proj = backend_.zeros({kv_width, hidden});
    layer->o_proj = backend_.zeros({hidden, q_width});
    layer->q_norm = backend_.zeros({head_dim});
    layer->k_norm = backend_.zeros({head_dim});
    if (layer->is_moe()) {
      const int64_t num_slots = placement->num_physical_experts() / shard.ep_size;  // this rank's slots
      const int64_t width = config.moe_intermediate_size / shard.moe_tp_size;
      layer->router = backend_.zeros({config.num_experts, hidden});
      layer->experts_gate_up = backend_.zeros({num_slots, 2 * width, hidden});
      layer->experts_down = backend_.zeros({num_slots, hidden, width});
      const auto map = placement->layer(layer->moe_layer_idx);
      layer->physical_to_logical.assign(map.begin(), map.end());
    } else {
      layer->mlp_gate_up = backend_.zeros({2 * mlp_width, hidden});
      layer->mlp_down = backend_.zeros({hidden, mlp_width});
    }
    layers_.push_back(std::move(layer));
  }
  if (is_first_stage()) embed_tokens_ = backend_.zeros({config.vocab_size, hidden});
  if (is_last_stage()) {
    norm_ = backend_.zeros({hidden});
    lm_head_ = config.tie_word_embeddings && is_first_stage() ? embed_tokens_
                                                               : backend_.zeros({config.vocab_size, hidden});
  }
  kv_pool_ = std::make_shared<KvPool>(backend_, static_cast<int>(layers_.size()), num_local_kv_heads(), head_dim);
}

Qwen3MoeModel::~Qwen3MoeModel() = default;

ExpertSlotView Qwen3MoeModel::slot_view(Layer& layer) {
  const auto num_slots = static_cast<int>(layer.experts_gate_up.dim(0));
  const int slot_begin = parallel_.shard.ep_rank * num_slots;
  std::span<int32_t> map(layer.physical_to_logical);
  return ExpertSlotView{layer.layer_idx,     layer.moe_layer_idx,   num_slots,
                        slot_begin,          static_cast<int>(map.size()), config_.num_experts,
                        layer.experts_gate_up, layer.experts_down,  map.subspan(slot_begin, num_slots),
                        map};
}

std::vector<ExpertSlotView> Qwen3MoeModel::expert_slot_views() {
  std::vector<ExpertSlotView> views;
  for (const auto& layer : layers_) {
    if (layer->is_moe()) views.push_back(slot_view(*layer));
  }
  return views;
}

KvCache Qwen3MoeModel::create_kv_cache(int64_t capacity) { return kv_pool_->create_cache(capacity); }

void Qwen3MoeModel::reserve_kv_pool(int64_t num_pages, int64_t page_size) { kv_pool_->reserve(num_pages, page_size); }

Tensor Qwen3MoeModel::embed(std::span<const SequenceInput> batch) {
  FULCRUM_CHECK(is_first_stage(), "embed: this stage owns layers [{}, {}), not the embedding", start_layer_,
                end_layer_);
  std::vector<int32_t> token_ids;
  for (const SequenceInput& seq : batch) token_ids.insert(token_ids.end(), seq.token_ids.begin(), seq.token_ids.end());
  return backend_.embedding(embed_tokens_, token_ids);  // [num_tokens, hidden_size]
}

Tensor Qwen3MoeModel::run_layers(const Tensor& hidden_in, std::span<const SequenceInput> batch,
                                 const ForwardHooks& hooks) {
  std::vector<int32_t> positions;  // [num_tokens]
  for (const SequenceInput& seq : batch) {
    FULCRUM_CHECK(seq.cache != nullptr && seq.cache->belongs_to(*kv_pool_),
                  "every sequence needs a live kv cache made by this stage");
    FULCRUM_CHECK(seq.cache->num_tokens + static_cast<int64_t>(seq.token_ids.size()) <= seq.cache->capacity,
                  "kv cache of capacity {} cannot take {} more tokens after {}", seq.cache->capacity,
                  seq.token_ids.size(), seq.cache->num_tokens);
    for (size_t i = 0; i < seq.token_ids.size(); ++i) {
      positions.push_back(static_cast<int32_t>(seq.cache->num_tokens + static_cast<int64_t>(i)));
    }
  }
  FULCRUM_CHECK(hidden_in.rank() == 2 && hidden_in.dim(0) == static_cast<int64_t>(positions.size()) &&
                    hidden_in.dim(1) == config_.hidden_size,
                "run_layers: hidden states must be [{}, {}]", positions.size(), config_.hidden_size);
  Tensor hidden = backend_.zeros(hidden_in.shape());  // [num_tokens, hidden_size], the residual stream
  backend_.copy(hidden, hidden_in);
  for (size_t local_idx = 0; local_idx < layers_.size(); ++local_idx) {
    Layer& layer = *layers_[local_idx];
    const Tensor normed = backend_.rms_norm(hidden, layer.input_layernorm, config_.rms_norm_eps);
    backend_.add_inplace(hidden, attention_block(layer, local_idx, normed, batch, positions));
    const Tensor normed2 = backend_.rms_norm(hidden, layer.post_attention_layernorm, config_.rms_norm_eps);
    backend_.add_inplace(hidden, layer.is_moe() ? moe_block(layer, normed2, hooks) : dense_mlp_block(layer, normed2));
  }
  return hidden;
}

Tensor Qwen3MoeModel::lm_head(const Tensor& hidden) {
  FULCRUM_CHECK(is_last_stage(), "lm_head: this stage owns layers [{}, {}), not the LM head", start_layer_,
                end_layer_);
  const Tensor normed = backend_.rms_norm(hidden, norm_, config_.rms_norm_eps);  // [num_tokens, hidden_size]
  return backend_.matmul(normed, lm_head_);                                      // [num_tokens, vocab_size]
}

void Qwen3MoeModel::commit_tokens(std::span<const SequenceInput> batch) {
  for (const SequenceInput& seq : batch) seq.cache->num_tokens += static_cast<int64_t>(seq.token_ids.size());
}

std::vector<Tensor> Qwen3MoeModel::forward(std::span<const SequenceInput> batch, const ForwardHooks& hooks) {
  FULCRUM_CHECK(is_first_stage() && is_last_stage(), "forward: this stage owns only layers [{}, {}) of {}",
                start_layer_, end_layer_, config_.num_hidden_layers);
  const Tensor hidden = run_layers(embed(batch), batch, hooks);  // [num_tokens, hidden_size]
  const Tensor logits = lm_head(hidden);                          // [num_tokens, vocab_size]
  commit_tokens(batch);
  std::vector<Tensor> per_sequence;
  int64_t offset = 0;
  for (const SequenceInput& seq : batch) {
    const auto num_tokens = static_cast<int64_t>(seq.token_ids.size());
    per_sequence.push_back(logits.rows(offset, num_tokens));  // [num_tokens, vocab_size]
    offset += num_tokens;
  }
  return per_sequence;
}

Tensor Qwen3MoeModel::attention_block(Layer& layer, size_t local_idx, const Tensor& x,
                                      std::span<const SequenceInput> batch, std::span<const int32_t> positions) {
  const int64_t num_tokens = x.dim(0), head_dim = config_.head_dim;
  const int64_t num_heads = num_local_heads(), num_kv_heads = num_local_kv_heads();  // this rank's shard
  // q/k RMSNorm over each head, before RoPE.
  Tensor q = backend_.matmul(x, layer.q_proj).reshape({num_tokens, num_heads, head_dim});
  q = backend_.rms_norm(q, layer.q_norm, config_.rms_norm_eps);     // [num_tokens, num_heads, head_dim]
  Tensor k = backend_.matmul(x, layer.k_proj).reshape({num_tokens, num_kv_heads, head_dim});
  k = backend_.rms_norm(k, layer.k_norm, config_.rms_norm_eps);     // [num_tokens, num_kv_heads, head_dim]
  const Tensor v = backend_.matmul(x, layer.v_proj).reshape({num_tokens, num_kv_heads, head_dim});
  backend_.rope_inplace(q, positions, config_.rope_theta);
  backend_.rope_inplace(k, positions, config_.rope_theta);

  Tensor out = backend_.zeros({num_tokens, num_heads * head_dim});  // [num_tokens, num_heads * head_dim]
  int64_t offset = 0;
  for (const SequenceInput& seq : batch) {
    const auto count = static_cast<int64_t>(seq.token_ids.size());
    if (count == 0) continue;
    const int64_t start_pos = seq.cache->num_tokens;
    const KvPages pages = kv_pool_->pages_of(*seq.cache);
    const Tensor& k_pool = kv_pool_->k(local_idx);  // [num_pages * page_size, num_kv_heads, head_dim]
    const Tensor& v_pool = kv_pool_->v(local_idx);
    backend_.write_kv(k_pool, k.rows(offset, count), pages, start_pos);
    backend_.write_kv(v_pool, v.rows(offset, count), pages, start_pos);
    const Tensor attn = backend_.paged_attention(q.rows(offset, count), k_pool, v_pool, pages,
                                                 start_pos);  // [count, num_heads * head_dim]
    backend_.copy(out.rows(offset, count), attn);
    offset += count;
  }
  const Tensor projected = backend_.matmul(out, layer.o_proj);  // [num_tokens, hidden_size], partial over heads
  if (parallel_.shard.attn_tp_size > 1) parallel_.ops->all_reduce_attention(projected);
  return projected;
}

Tensor Qwen3MoeModel::dense_mlp_block(Layer& layer, const Tensor& x) {
  const Tensor gate_up = backend_.matmul(x, layer.mlp_gate_up);  // [num_tokens, 2 * intermediate_size / A]
  const Tensor act = backend_.silu_mul(gate_up);                 // [num_tokens, intermediate_size / A]
  const Tensor out = backend_.matmul(act, layer.mlp_down);       // [num_tokens, hidden_size], partial over A
  if (parallel_.shard.attn_tp_size > 1) parallel_.ops->all_reduce_attention(out);
  return out;
}

Tensor Qwen3MoeModel::moe_block(Layer& layer, const Tensor& x, const ForwardHooks& hooks) {
  const int64_t num_tokens = x.dim(0);
  const int top_k = config_.num_experts_per_tok;
  const Tensor router_logits = backend_.matmul(x, layer.router);  // [num_tokens, num_experts]
  const RouterChoice choice = backend_.route(router_logits, top_k, config_.norm_topk_prob);
  if (hooks.on_router) hooks.on_router(layer.layer_idx, router_logits, choice);
  if (parallel_.ops != nullptr) return parallel_.ops->moe_experts(slot_view(layer), x, choice);

  // Each logical expert's first replica computes all its tokens.
  std::vector<int32_t> first_slot(static_cast<size_t>(config_.num_experts), -1);  // [num_experts]
  for (int32_t slot_idx = static_cast<int32_t>(layer.physical_to_logical.size()) - 1; slot_idx >= 0; --slot_idx) {
    const int32_t expert_idx = layer.physical_to_logical[slot_idx];
    FULCRUM_CHECK(expert_idx >= 0 && expert_idx < config_.num_experts,
                  "layer {}: physical slot {} holds logical expert {}, outside [0, {})", layer.layer_idx, slot_idx,
                  expert_idx, config_.num_experts);
    first_slot[expert_idx] = slot_idx;
  }
  // Entry t * top_k + j: token t's j-th expert in ascending logical-expert order (HF sums in that order).
  const auto num_entries = static_cast<size_t>(num_tokens * top_k);
  std::vector<float> entry_weights(num_entries);
  std::vector<std::vector<int32_t>> slot_tokens(layer.physical_to_logical.size());
  std::vector<std::vector<int32_t>> slot_entries(layer.physical_to_logical.size());
  std::vector<int> order(static_cast<size_t>(top_k));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t* ids = choice.expert_ids.data() + t * top_k;
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return ids[a] < ids[b]; });
    for (int j = 0; j < top_k; ++j) {
      const auto entry_idx = static_cast<int32_t>(t * top_k + j);
      const int32_t expert_idx = ids[order[j]];
      const int32_t slot_idx = first_slot[expert_idx];
      FULCRUM_CHECK(slot_idx >= 0, "layer {}: logical expert {} has no physical slot", layer.layer_idx, expert_idx);
      entry_weights[entry_idx] = choice.weights[t * top_k + order[j]];
      slot_tokens[slot_idx].push_back(static_cast<int32_t>(t));
      slot_entries[slot_idx].push_back(entry_idx);
    }
  }
  Tensor expert_out = backend_.zeros({num_tokens * top_k, int64_t{config_.hidden_size}});  // [num_entries, hidden]
  for (size_t slot_idx = 0; slot_idx < slot_tokens.size(); ++slot_idx) {
    if (slot_tokens[slot_idx].empty()) continue;
    const Tensor xs = backend_.gather_rows(x, slot_tokens[slot_idx]);  // [n, hidden_size]
    const auto slot = static_cast<int64_t>(slot_idx);
    const Tensor ys = expert_mlp(backend_, xs, layer.experts_gate_up.index(slot), layer.experts_down.index(slot));
    backend_.scatter_rows(expert_out, ys, slot_entries[slot_idx]);
  }
  return backend_.weighted_sum(expert_out, entry_weights, top_k);  // [num_tokens, hidden_size]
}

}  // namespace fulcrum::model
