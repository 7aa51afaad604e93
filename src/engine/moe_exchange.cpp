#include "engine/moe_exchange.hpp"

#include <algorithm>
#include <numeric>

#include "eplb/error.hpp"

namespace fulcrum::engine {

StageParallelOps::StageParallelOps(const ParallelLayout& layout, const RankCoords& coords,
                                   const model::Qwen3MoeConfig& config, comm::Communicator& stage,
                                   comm::Communicator& attn_tp, model::Backend& backend, const EngineOptions& options)
    : layout_(layout), coords_(coords), config_(config), stage_(stage), attn_tp_(attn_tp), backend_(backend),
      options_(options) {
  FULCRUM_CHECK(stage.size() == layout.tp() && stage.rank() == coords.tp_rank, "stage group: rank {} of {}",
                stage.rank(), stage.size());
  FULCRUM_CHECK(attn_tp.size() == layout.attn_tp_size() && attn_tp.rank() == coords.attn_tp_rank,
                "attention TP group: rank {} of {}", attn_tp.rank(), attn_tp.size());
  const int slots_per_ep_rank = layout.num_physical_experts() / layout.ep();
  dispatcher_ = make_token_dispatcher(options.moe_a2a_backend, stage, backend, config.hidden_size, slots_per_ep_rank,
                                      layout.moe_tp_size());
}

void StageParallelOps::all_reduce_attention(const model::Tensor& x) {
  std::vector<float> host = backend_.download(x);  // [num_tokens, hidden_size]
  attn_tp_.all_reduce_sum(host);
  backend_.upload(x, host);
}

model::Tensor StageParallelOps::moe_experts(const model::ExpertSlotView& layer, const model::Tensor& x,
                                            const model::RouterChoice& choice) {
  const int64_t hidden = config_.hidden_size, num_tokens = x.dim(0);
  const int top_k = choice.top_k, a = coords_.attn_tp_rank, num_chunks = layout_.attn_tp_size();
  // 1. This rank's chunk of the group's tokens and its entries, each token's experts ascending.
  const int64_t chunk_begin = a * (num_tokens / num_chunks) + std::min<int64_t>(a, num_tokens % num_chunks);
  const int64_t chunk_size = num_tokens / num_chunks + (a < num_tokens % num_chunks ? 1 : 0);
  const model::Tensor x_chunk = x.rows(chunk_begin, chunk_size);  // [chunk_size, hidden_size]
  std::vector<int32_t> entry_token, entry_expert;                  // [chunk_size * top_k]
  std::vector<float> entry_weight;                                 // [chunk_size * top_k]
  std::vector<int> order(static_cast<size_t>(top_k));
  for (int64_t t = 0; t < chunk_size; ++t) {
    const size_t base = static_cast<size_t>((chunk_begin + t) * top_k);
    const int32_t* ids = choice.expert_ids.data() + base;
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int i, int j) { return ids[i] < ids[j]; });
    for (const int j : order) {
      entry_token.push_back(static_cast<int32_t>(t));
      entry_expert.push_back(ids[j]);
      entry_weight.push_back(choice.weights[base + static_cast<size_t>(j)]);
    }
  }

  // 2. Replica choice and token exchange.
  ReplicaChooser& chooser = choosers_.try_emplace(layer.layer_idx, options_.dispatch_algorithm, options_.dispatch_seed,
                                                  layout_.tp(), layout_.moe_tp_size())
                                .first->second;
  chooser.set_layer(layer.moe_layer_idx, layer.layer_map, config_.num_experts,
                    eplb::Topology{layer.num_physical_experts, layout_.ep(), 1});
  std::vector<int32_t> my_slots(entry_expert.size(), -1);  // [chunk_size * top_k]
  if (!dispatcher_->needs_all_tokens()) {
    std::vector<int64_t> counts;  // [tp][num_experts], only for balanced dispatch
    if (chooser.needs_counts()) {
      std::vector<int64_t> mine(static_cast<size_t>(config_.num_experts), 0);
      for (const int32_t e : entry_expert) ++mine[e];
      counts.resize(mine.size() * static_cast<size_t>(layout_.tp()));
      stage_.all_gather(comm::bytes_of(std::span<const int64_t>(mine)), comm::writable_bytes_of(std::span<int64_t>(counts)));
    }
    chooser.begin_pass(pass_idx_, counts);
    chooser.choose(coords_.tp_rank, entry_expert, my_slots);
  }
  DispatchedTokens dispatched = dispatcher_->dispatch(x_chunk, entry_token, entry_expert, my_slots);
  if (dispatcher_->needs_all_tokens()) {
    choose_all(chooser, dispatched);
    const auto first = std::find(dispatched.source.begin(), dispatched.source.end(), coords_.tp_rank);
    const auto offset = first - dispatched.source.begin();
    std::copy_n(dispatched.slot.begin() + offset, my_slots.size(), my_slots.begin());
  }
  if (options_.on_routing) {
    options_.on_routing(RoutingRecord{pass_idx_, layer.layer_idx, layer.moe_layer_idx, coords_.tp_rank, top_k,
                                      entry_expert, my_slots});
  }

  // 3-4. Compute this rank's slots, combine at the sources.
  const model::Tensor entry_out = dispatcher_->combine(compute_local(layer, dispatched));  // [chunk * top_k, hidden]
  // 5. Weighted sum per token, then the group's chunks back together.
  const model::Tensor chunk_out = backend_.weighted_sum(entry_out, entry_weight, top_k);  // [chunk_size, hidden]
  if (num_chunks == 1) return chunk_out;
  std::vector<int64_t> chunk_bytes(static_cast<size_t>(num_chunks));
  for (int r = 0; r < num_chunks; ++r) {
    const int64_t size = num_tokens / num_chunks + (r < num_tokens % num_chunks ? 1 : 0);
    chunk_bytes[r] = size * hidden * static_cast<int64_t>(sizeof(float));
  }
  const std::vector<float> host = backend_.download(chunk_out);
  std::vector<float> all(static_cast<size_t>(num_tokens * hidden));  // [num_tokens, hidden_size]
  attn_tp_.all_gather_v(comm::bytes_of(std::span<const float>(host)), comm::writable_bytes_of(std::span<float>(all)),
                        chunk_bytes);
  model::Tensor out = backend_.zeros({num_tokens, hidden});
  backend_.upload(out, all);
  return out;
}

void StageParallelOps::choose_all(ReplicaChooser& chooser, DispatchedTokens& dispatched) {
  const size_t num_entries = dispatched.source.size();
  std::vector<int64_t> counts;  // [tp][num_experts]
  if (chooser.needs_counts()) {
    counts.assign(static_cast<size_t>(layout_.tp()) * config_.num_experts, 0);
    for (size_t i = 0; i < num_entries; ++i) {
      ++counts[static_cast<size_t>(dispatched.source[i]) * config_.num_experts + dispatched.expert[i]];
    }
  }
  chooser.begin_pass(pass_idx_, counts);
  for (size_t begin = 0; begin < num_entries;) {  // entries arrive grouped by source, in entry order
    size_t end = begin;
    while (end < num_entries && dispatched.source[end] == dispatched.source[begin]) ++end;
    chooser.choose(dispatched.source[begin], std::span<const int32_t>(dispatched.expert).subspan(begin, end - begin),
                   std::span<int32_t>(dispatched.slot).subspan(begin, end - begin));
    begin = end;
  }
}

model::Tensor StageParallelOps::compute_local(const model::ExpertSlotView& layer, const DispatchedTokens& dispatched) {
  const auto num_entries = static_cast<int64_t>(dispatched.slot.size());
  model::Tensor outputs = backend_.zeros({num_entries, int64_t{config_.hidden_size}});  // [entries, hidden_size]
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(layer.num_slots)), entries(rows.size());
  for (int64_t i = 0; i < num_entries; ++i) {
    const int local = dispatched.slot[i] - layer.slot_begin;
    if (local < 0 || local >= layer.num_slots) continue;  // another EP rank's slot (allgather)
    FULCRUM_CHECK(layer.physical_to_logical[local] == dispatched.expert[i],
                  "layer {}: slot {} holds expert {}, but an entry of expert {} was sent to it", layer.layer_idx,
                  dispatched.slot[i], layer.physical_to_logical[local], dispatched.expert[i]);
    rows[local].push_back(dispatched.entry_row[i]);
    entries[local].push_back(static_cast<int32_t>(i));
  }
  for (int local = 0; local < layer.num_slots; ++local) {
    if (rows[local].empty()) continue;
    const model::Tensor xs = backend_.gather_rows(dispatched.rows, rows[local]);  // [n, hidden_size]
    const model::Tensor ys = model::expert_mlp(backend_, xs, layer.gate_up.index(local), layer.down.index(local));
    backend_.scatter_rows(outputs, ys, entries[local]);  // ys: [n, hidden_size], partial over this rank's slice
  }
  return outputs;
}

}  // namespace fulcrum::engine
