#pragma once
// Token dispatch backends of the MoE layer (--moe-a2a-backend), over the tp ranks of one pipeline stage.
// An "entry" is one (token, chosen expert) pair: a token has num_experts_per_tok entries.
//   allgather  every rank receives every entry of the stage (tokens of all attention-DP groups) and
//              computes those whose slot it holds; partial results are reduce-scattered back to sources.
//   alltoall   each entry is sent only to the ranks holding its chosen slot (the M ranks of its EP rank),
//              and their partial results are sent back and summed at the source (the DeepEP-class path).
// NOTES: the MoE layer reads needs_all_tokens() to choose its path: with allgather, replicas are chosen
// after dispatch, on every rank alike, from every entry; with alltoall, each source chooses before it.
// Both return, per source entry, the sum of the M partial outputs in ascending tp rank, starting from zero:
// bitwise the same value whichever backend, replica or EP rank computed it.
// The [tokens, hidden] row payloads move through a RowExchange (row_exchange.hpp): GPU to GPU through NCCL
// with the CUDA backend on an NCCL stage, through the host otherwise; counts and ids always via the host.
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "comm/communicator.hpp"
#include "engine/row_exchange.hpp"
#include "model/backend.hpp"

namespace fulcrum::engine {

// What dispatch() hands a rank: token rows, and the entries that reference them.
struct DispatchedTokens {
  model::Tensor rows;              // [num_rows, hidden_size]
  std::vector<int32_t> entry_row;  // [num_entries]: row of `rows` holding the entry's token
  std::vector<int32_t> source;     // [num_entries]: stage tp rank that originated the entry
  std::vector<int32_t> expert;     // [num_entries]: logical expert
  std::vector<int32_t> slot;       // [num_entries]: global physical slot (-1 until chosen, with allgather)
};

class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  virtual std::string_view name() const = 0;
  virtual bool needs_all_tokens() const = 0;
  // The path the rows take (row_exchange().path()), and how many row collectives it made.
  virtual const RowExchange& row_exchange() const = 0;
  // This rank's entries: x [num_tokens, hidden_size], entry_token [n] (row of x), entry_expert [n],
  // entry_slot [n] (chosen slots; ignored when needs_all_tokens()). Collective over the stage.
  virtual DispatchedTokens dispatch(const model::Tensor& x, std::span<const int32_t> entry_token,
                                    std::span<const int32_t> entry_expert, std::span<const int32_t> entry_slot) = 0;
  // outputs [num_entries of the last dispatch, hidden_size]: this rank's partial results (zero rows for
  // entries it did not compute) -> [n of this rank's entries, hidden_size], summed over the ranks holding
  // each entry's slot. Collective over the stage.
  virtual model::Tensor combine(const model::Tensor& outputs) = 0;
};

// name: "allgather" | "alltoall" (anything else: fulcrum::Error listing them). `stage` is the tp group of
// one pipeline stage; slot s lives on tp ranks [s / slots_per_ep_rank * M, +M), M = ranks_per_ep_rank.
// `rows`: the path of the row payloads; null picks make_row_exchange(stage, backend).
std::unique_ptr<TokenDispatcher> make_token_dispatcher(std::string_view name, comm::Communicator& stage,
                                                       model::Backend& backend, int hidden_size,
                                                       int slots_per_ep_rank, int ranks_per_ep_rank,
                                                       std::unique_ptr<RowExchange> rows = nullptr);

}  // namespace fulcrum::engine
