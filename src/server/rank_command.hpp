#pragma once
// What EngineStepExecutor asks of every rank, as plain data: the threaded ranks read it in place, and with
// ranks as processes (serve --multi-process) world rank 0 broadcasts it to the others, whose loop
// (EngineStepExecutor::serve_as_worker) runs the same code on it. Only this crosses processes besides
// what the ranks exchange themselves in a pass (the MoE exchange, the EPLB loads, plans and migrations).
//
// Wire format (host byte order, as every rank runs the same build): int32 kind, then the fields of that
// kind, each vector as an int64 count then its elements; see encode().
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "comm/communicator.hpp"
#include "model/step_model.hpp"

namespace fulcrum::server {

struct RankCommand {
  enum class Kind : int32_t {
    kAdd = 1,         // drop `releases`, then add sequence `id` with room for `capacity` positions, in
                      // attention-DP group `dp_group` (-1: the engine's choice), pages from the pool
    kAddOnPages = 2,  // drop `releases`, then add `id` over `page_ids` of attention-DP group `dp_group`
    kPass = 3,        // drop `releases`, then one forward pass over the batch and the EPLB step
    kStop = 4,        // the worker ranks leave their loop (the server stops)
  };
  Kind kind = Kind::kPass;
  std::vector<model::SequenceId> releases;
  // kAdd, kAddOnPages
  model::SequenceId id = 0;
  int64_t capacity = 0;
  int32_t dp_group = -1;
  std::vector<int32_t> page_ids;
  int64_t num_cached_tokens = 0;
  int32_t copy_source_page = -1;  // kAddOnPages: model::SequencePages::copy_source_page
  // kPass: entry i is sequence batch_ids[i] with new tokens batch_tokens[i], logits of its last batch_last_rows[i]
  // positions (the sampling row and the prompt rows asked for logprobs)
  std::vector<model::SequenceId> batch_ids;
  std::vector<std::vector<int32_t>> batch_tokens;
  std::vector<int64_t> batch_last_rows;
  uint64_t pass_idx = 0;
  bool record_routing = false;  // the endpoints' recorder is on: worker ranks send their routing counts

  bool operator==(const RankCommand&) const = default;
};

std::vector<std::byte> encode(const RankCommand& command);
// Throws a one-line error on a truncated or malformed message.
RankCommand decode_rank_command(std::span<const std::byte> bytes);

// Collective over `world`: world rank 0's `command` reaches every rank (size, then the bytes).
void broadcast_command(comm::Communicator& world, RankCommand& command);

// Collective: every rank's error text ("" where none), in rank order.
std::vector<std::string> gather_errors(comm::Communicator& world, const std::string& mine);

}  // namespace fulcrum::server
