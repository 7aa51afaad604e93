#pragma once
// Merging a layer's slot transfers into few NCCL ops, shared by the slot-migration executors
// (NcclSlotCopyExecutor, NcclSlotPoolMigration). Each NCCL op costs ~10 us on top of its bytes, so slots
// whose storage is consecutive on BOTH sides of a pair go as one op per tensor. A side knows only its own
// storage, so the two ranks of a pair first swap (over the communicator's send/recv, a few bytes each
// way) where their runs of consecutive indices start, and both cut the pair's slot list at the union of
// those starts: the sender's ops and the receiver's ops then have the same byte counts, in the same order.
// NOTES: both ranks of a pair must call this for the same layer, with the pair's slots in the same order
// (sender's sends to r == receiver's recvs from the sender); send/recv are buffered, so every rank sends
// its starts first, then receives the peers'.
// Plain C++: the device pointers are only carried, never dereferenced.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/nccl_communicator.hpp"

namespace fulcrum::comm {

// One slot of a layer's transfer to or from `peer`: `index` is its storage index (consecutive indices are
// adjacent in memory, tensor by tensor), gate_up / down its device addresses.
struct SlotRunItem {
  int peer = 0;
  int index = 0;
  std::byte* gate_up = nullptr;
  std::byte* down = nullptr;
};

struct SlotRunOps {
  std::vector<NcclCommunicator::DeviceSend> sends;  // per segment: gate_up op, then down op
  std::vector<NcclCommunicator::DeviceRecv> recvs;
};

// Segments of `sends` / `recvs` (each in this rank's posting order; grouped per peer internally), each a run
// of slots consecutive on both sides; gate_up_bytes / down_bytes are one slot's tensor sizes.
// Collective between every pair of ranks that exchange slots (host messages over `host`).
SlotRunOps merge_slot_runs(Communicator& host, std::span<const SlotRunItem> sends, std::span<const SlotRunItem> recvs,
                           int64_t gate_up_bytes, int64_t down_bytes);

}  // namespace fulcrum::comm
