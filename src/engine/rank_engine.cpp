#include "engine/rank_engine.hpp"

#include <algorithm>
#include <numeric>
#include <set>

#include "eplb/error.hpp"

namespace fulcrum::engine {
namespace {

// The placement the engine runs: the given one (checked against the layout), or the trivial one over P slots.
eplb::Placement engine_placement(const model::Qwen3MoeConfig& config, const ParallelLayout& layout,
                                 const eplb::Placement* given) {
  const int num_moe_layers = static_cast<int>(config.moe_layer_indices().size());
  const eplb::Topology topo{layout.num_physical_experts(), layout.ep(), 1};
  if (given == nullptr) return eplb::trivial_placement(topo, num_moe_layers, config.num_experts);
  FULCRUM_CHECK(given->num_layers == num_moe_layers && given->num_logical_experts == config.num_experts &&
                    given->num_physical_experts() == layout.num_physical_experts(),
                "the placement has {} layers x {} slots of {} experts; this model and layout need {} MoE layers x {} "
                "slots of {} experts",
                given->num_layers, given->num_physical_experts(), given->num_logical_experts, num_moe_layers,
                layout.num_physical_experts(), config.num_experts);
  eplb::Placement placement = *given;
  placement.topology = topo;  // slots live on EP ranks as the layout says, whatever GPU count planned them
  placement.validate();
  return placement;
}

}  // namespace

RankEngine::RankEngine(const model::Qwen3MoeConfig& config, const ParallelLayout& layout, comm::Communicator& world,
                       model::Backend& backend, const eplb::Placement* placement, EngineOptions options)
    : config_(config), layout_(layout), coords_(layout.coords(world.rank())), backend_(backend),
      options_(std::move(options)) {
  FULCRUM_CHECK(world.size() == layout.world_size(), "the world has {} ranks, the layout needs {} ({})", world.size(),
                layout.world_size(), layout.describe());
  stage_ = world.split(coords_.pp_rank, coords_.tp_rank);
  attn_tp_ = world.split(coords_.pp_rank * layout.attn_dp_size() + coords_.attn_dp_rank, coords_.attn_tp_rank);
  pp_ = world.split(coords_.tp_rank, coords_.pp_rank);
  ops_ = std::make_unique<StageParallelOps>(layout, coords_, config, *stage_, *attn_tp_, backend, options_);
  const bool has_moe = !config.moe_layer_indices().empty();
  const eplb::Placement slots = has_moe ? engine_placement(config, layout, placement) : eplb::Placement{};
  model_ = std::make_unique<model::Qwen3MoeModel>(config, backend, layout.stage(coords_.pp_rank),
                                                  has_moe ? &slots : nullptr,
                                                  model::ModelParallel{layout.shard(coords_.world_rank), ops_.get()});
}

RankEngine::~RankEngine() = default;

void RankEngine::load_weights(model::Checkpoint& checkpoint) { model_->load_weights(checkpoint); }

int RankEngine::add_sequence(SequenceId id, int64_t capacity, int dp_group) {
  FULCRUM_CHECK(!live_.contains(id), "sequence {} is already live", id);
  FULCRUM_CHECK(capacity > 0, "sequence {}: capacity must be positive, got {}", id, capacity);
  FULCRUM_CHECK(dp_group >= -1 && dp_group < layout_.attn_dp_size(), "sequence {}: attention-DP group {} outside [0, {})",
                id, dp_group, layout_.attn_dp_size());
  if (group_sizes_.empty()) group_sizes_.assign(static_cast<size_t>(layout_.attn_dp_size()), 0);
  const int group = dp_group >= 0 ? dp_group
                                  : static_cast<int>(std::min_element(group_sizes_.begin(), group_sizes_.end()) -
                                                     group_sizes_.begin());
  LiveSequence seq;
  seq.dp_group = group;
  if (group == coords_.attn_dp_rank) seq.cache = model_->create_kv_cache(capacity);
  live_.emplace(id, std::move(seq));
  ++group_sizes_[static_cast<size_t>(group)];
  return group;
}

void RankEngine::add_sequence_on_pages(SequenceId id, int64_t capacity, int dp_group, std::span<const int32_t> page_ids,
                                       int64_t num_cached_tokens, int32_t copy_source_page) {
  FULCRUM_CHECK(!live_.contains(id), "sequence {} is already live", id);
  FULCRUM_CHECK(capacity > 0, "sequence {}: capacity must be positive, got {}", id, capacity);
  FULCRUM_CHECK(dp_group >= 0 && dp_group < layout_.attn_dp_size(), "sequence {}: attention-DP group {} outside [0, {})",
                id, dp_group, layout_.attn_dp_size());
  if (group_sizes_.empty()) group_sizes_.assign(static_cast<size_t>(layout_.attn_dp_size()), 0);
  LiveSequence seq;
  seq.dp_group = dp_group;
  if (dp_group == coords_.attn_dp_rank) seq.cache = model_->map_kv_cache(page_ids, capacity, num_cached_tokens, copy_source_page);
  live_.emplace(id, std::move(seq));
  ++group_sizes_[static_cast<size_t>(dp_group)];
}

void RankEngine::drop_sequence(SequenceId id) {
  const auto it = live_.find(id);
  if (it == live_.end()) return;
  --group_sizes_[static_cast<size_t>(it->second.dp_group)];
  live_.erase(it);
}

void RankEngine::reset(const std::vector<int64_t>& capacities) {
  live_.clear();
  group_sizes_.clear();
  for (size_t i = 0; i < capacities.size(); ++i) add_sequence(static_cast<SequenceId>(i), capacities[i]);
}

std::vector<model::HostTensor> RankEngine::forward(const std::vector<std::vector<int32_t>>& new_tokens) {
  FULCRUM_CHECK(new_tokens.size() == live_.size(), "forward: {} sequences, reset() made room for {}", new_tokens.size(),
                live_.size());
  std::vector<SequenceTokens> batch;
  for (size_t i = 0; i < new_tokens.size(); ++i) batch.push_back({static_cast<SequenceId>(i), new_tokens[i]});
  return forward(batch, LogitRows::kAll);
}

std::vector<model::HostTensor> RankEngine::forward(std::span<const SequenceTokens> entries, LogitRows rows) {
  // The entries of each DP group, in batch order; this rank runs its own group's.
  const int num_groups = layout_.attn_dp_size(), group_size = layout_.attn_tp_size();
  std::vector<std::vector<size_t>> by_group(static_cast<size_t>(num_groups));
  std::set<SequenceId> seen;
  for (size_t e = 0; e < entries.size(); ++e) {
    const auto it = live_.find(entries[e].id);
    FULCRUM_CHECK(it != live_.end(), "forward: sequence {} is not live", entries[e].id);
    FULCRUM_CHECK(seen.insert(entries[e].id).second, "forward: sequence {} twice in one pass", entries[e].id);
    by_group[static_cast<size_t>(it->second.dp_group)].push_back(e);
  }
  ops_->begin_pass(pass_idx_++);
  std::vector<model::SequenceInput> batch;
  int64_t num_tokens = 0;  // this rank's attention-DP group
  for (const size_t e : by_group[static_cast<size_t>(coords_.attn_dp_rank)]) {
    model::KvCache& cache = *live_.at(entries[e].id).cache;
    FULCRUM_CHECK(cache.num_tokens + static_cast<int64_t>(entries[e].token_ids.size()) <= cache.capacity,
                  "forward: sequence {} would exceed its capacity {}", entries[e].id, cache.capacity);
    batch.push_back(model::SequenceInput{entries[e].token_ids, &cache});
    num_tokens += static_cast<int64_t>(entries[e].token_ids.size());
  }
  const int64_t hidden_size = config_.hidden_size, vocab_size = config_.vocab_size;
  model::Tensor hidden;  // [num_tokens, hidden_size]
  if (model_->is_first_stage()) {
    hidden = model_->embed(batch);
  } else {
    std::vector<float> host(static_cast<size_t>(num_tokens * hidden_size));
    pp_->recv(comm::writable_bytes_of(std::span<float>(host)), coords_.pp_rank - 1);
    hidden = backend_.zeros({num_tokens, hidden_size});
    backend_.upload(hidden, host);
  }
  hidden = model_->run_layers(hidden, batch);
  model::Qwen3MoeModel::commit_tokens(batch);
  if (!model_->is_last_stage()) {
    const std::vector<float> host = backend_.download(hidden);
    pp_->send(comm::bytes_of(std::span<const float>(host)), coords_.pp_rank + 1);
  }

  // Rows of logits per entry: its new tokens, or its last one (none when it has no new token).
  const auto num_rows = [&](size_t e) -> int64_t {
    const auto count = static_cast<int64_t>(entries[e].token_ids.size());
    return rows == LogitRows::kAll ? count : std::min<int64_t>(count, std::max<int64_t>(entries[e].num_last_rows, 1));
  };
  // Every entry's logits to every rank: gathered over the last stage (one rank per DP group gives its
  // group's), then broadcast down the pipeline. Order: DP group 0's entries, group 1's, ...
  std::vector<int64_t> group_rows(static_cast<size_t>(num_groups), 0);
  for (int g = 0; g < num_groups; ++g) {
    for (const size_t e : by_group[static_cast<size_t>(g)]) group_rows[static_cast<size_t>(g)] += num_rows(e);
  }
  const int64_t total = std::accumulate(group_rows.begin(), group_rows.end(), int64_t{0});
  std::vector<float> all(static_cast<size_t>(total * vocab_size));  // [total rows, vocab_size]
  if (model_->is_last_stage()) {
    if (rows == LogitRows::kLast) {
      std::vector<int32_t> last;  // rows of each entry's last new tokens in `hidden`
      int64_t offset = 0;
      const std::vector<size_t>& mine = by_group[static_cast<size_t>(coords_.attn_dp_rank)];
      for (size_t b = 0; b < batch.size(); ++b) {
        offset += static_cast<int64_t>(batch[b].token_ids.size());
        for (int64_t k = num_rows(mine[b]); k > 0; --k) last.push_back(static_cast<int32_t>(offset - k));
      }
      hidden = backend_.gather_rows(hidden, last);
    }
    const std::vector<float> logits = backend_.download(model_->lm_head(hidden));  // [rows, vocab_size]
    const bool contributes = coords_.attn_tp_rank == 0;
    std::vector<int64_t> bytes(static_cast<size_t>(layout_.tp()), 0);
    for (int g = 0; g < num_groups; ++g) bytes[g * group_size] = group_rows[g] * vocab_size * int64_t{sizeof(float)};
    stage_->all_gather_v(comm::bytes_of(std::span<const float>(logits).first(contributes ? logits.size() : 0)),
                         comm::writable_bytes_of(std::span<float>(all)), bytes);
  }
  if (layout_.pp() > 1) pp_->broadcast(comm::writable_bytes_of(std::span<float>(all)), layout_.pp() - 1);

  std::vector<model::HostTensor> out(entries.size());
  int64_t offset = 0;
  for (int g = 0; g < num_groups; ++g) {
    for (const size_t e : by_group[static_cast<size_t>(g)]) {
      const int64_t count = num_rows(e);
      out[e].shape = {count, vocab_size};
      out[e].data.assign(all.begin() + offset * vocab_size, all.begin() + (offset + count) * vocab_size);
      offset += count;
    }
  }
  return out;
}

int RankEngine::owned_moe_layer(int moe_layer_idx) const {
  const std::vector<int> moe_layers = config_.moe_layer_indices();
  FULCRUM_CHECK(moe_layer_idx >= 0 && moe_layer_idx < static_cast<int>(moe_layers.size()),
                "MoE layer {} does not exist (the model has {})", moe_layer_idx, moe_layers.size());
  const int layer_idx = moe_layers[static_cast<size_t>(moe_layer_idx)];
  return model_->owns_layer(layer_idx) ? layer_idx : -1;
}

void RankEngine::replace_layer_placement(int moe_layer_idx, std::span<const int32_t> layer_map,
                                         model::Checkpoint& checkpoint) {
  const int layer_idx = owned_moe_layer(moe_layer_idx);
  if (layer_idx >= 0) model_->replace_layer_map(layer_idx, layer_map, checkpoint);
}

void RankEngine::commit_layer_placement(int moe_layer_idx, std::span<const int32_t> layer_map) {
  const int layer_idx = owned_moe_layer(moe_layer_idx);
  if (layer_idx >= 0) model_->set_layer_map(layer_idx, layer_map);
}

}  // namespace fulcrum::engine
