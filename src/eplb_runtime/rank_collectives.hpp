#pragma once
// Small typed collectives over comm::Communicator used by the EPLB runtime. Every rank gets the same
// bytes back, so results derived from them agree across ranks.
#include <cstdint>
#include <span>
#include <vector>

#include "comm/communicator.hpp"

namespace fulcrum::eplb_runtime {

// Every rank's `values` (same length on every rank, checked), concatenated in rank order.
std::vector<int64_t> all_gather_int64(comm::Communicator& comm, std::span<const int64_t> values);

// Element-wise sum over ranks in rank order (exact); same length on every rank (checked).
std::vector<int64_t> all_reduce_sum_int64(comm::Communicator& comm, std::span<const int64_t> values);

// Variable lengths: every rank's `values` concatenated in rank order; `counts_out` (optional) gets each
// rank's length.
std::vector<int32_t> all_gather_v_int32(comm::Communicator& comm, std::span<const int32_t> values,
                                        std::vector<int64_t>* counts_out = nullptr);

}  // namespace fulcrum::eplb_runtime
