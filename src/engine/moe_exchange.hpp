#pragma once
// The collective steps of one rank's sharded model (model::ParallelOps): the attention all-reduce and the
// MoE layer's token exchange, over the groups of the rank's pipeline stage.
//
// MoE layer, per rank (parallel_layout.hpp for the groups):
//   1. take this rank's chunk of its attention-DP group's tokens; list its entries (token, expert) with
//      each token's experts in ascending logical order (the order the single-rank model sums them in);
//   2. choose replicas (ReplicaChooser) and exchange tokens (TokenDispatcher): before dispatch at the
//      source (alltoall), or after it on every rank alike (allgather, needs_all_tokens());
//   3. compute the received entries whose slot this rank holds, on its slice of moe_intermediate_size;
//   4. combine: each entry's output summed over the ranks sharing the slot, back at its source;
//   5. weight and sum each token's entries, then all-gather the chunks inside the attention TP group.
#include <map>
#include <memory>

#include "comm/communicator.hpp"
#include "engine/engine_options.hpp"
#include "engine/parallel_layout.hpp"
#include "engine/replica_choice.hpp"
#include "engine/token_dispatcher.hpp"
#include "model/qwen3_moe.hpp"

namespace fulcrum::engine {

class StageParallelOps final : public model::ParallelOps {
 public:
  // `stage`: the tp ranks of this pipeline stage (rank = tp rank); `attn_tp`: this rank's attention TP group.
  StageParallelOps(const ParallelLayout& layout, const RankCoords& coords, const model::Qwen3MoeConfig& config,
                   comm::Communicator& stage, comm::Communicator& attn_tp, model::Backend& backend,
                   const EngineOptions& options);

  // Every rank of the stage starts pass `pass_idx` before running its layers.
  void begin_pass(uint64_t pass_idx) { pass_idx_ = pass_idx; }
  const TokenDispatcher& dispatcher() const { return *dispatcher_; }

  void all_reduce_attention(const model::Tensor& x) override;
  model::Tensor moe_experts(const model::ExpertSlotView& layer, const model::Tensor& x,
                            const model::RouterChoice& choice) override;

 private:
  // Slots [n] of dispatched entries (allgather): every source's block chosen alike on every rank.
  void choose_all(ReplicaChooser& chooser, DispatchedTokens& dispatched);
  // Partial outputs [entries, hidden_size] of the dispatched entries whose slot this rank holds.
  model::Tensor compute_local(const model::ExpertSlotView& layer, const DispatchedTokens& dispatched);

  const ParallelLayout& layout_;
  RankCoords coords_;
  const model::Qwen3MoeConfig& config_;
  comm::Communicator& stage_;
  comm::Communicator& attn_tp_;
  model::Backend& backend_;
  const EngineOptions& options_;
  std::unique_ptr<TokenDispatcher> dispatcher_;
  std::map<int, ReplicaChooser> choosers_;  // per owned MoE layer (decoder index)
  uint64_t pass_idx_ = 0;
};

}  // namespace fulcrum::engine
