#pragma once
// Live slot migration of the bf16 GPU MoE layers (backend::GpuSlotPool), layer by layer, with zero-copy commits:
// a layer's incoming slots are received into FREE pool buffers while the forward passes keep reading the live
// ones, and the commit only remaps the layer's slots to the new buffers (the old ones return to the free list).
//
// Use, on every EP rank, the same layers in the same order:
//   auto migration_comm = ep_comm.duplicate();   // dedicated: never orders against the forward's collectives
//   NcclSlotPoolMigration migration(pool, *migration_comm, topology);
//   migration.begin_layer(l, old_row, new_row);  // returns at once
//   while (!migration.ready()) run_forward();    // forward passes keep running on the old pointers
//   migration.commit(layer.stream());            // waits for the transfer, remaps; no collective
//   layer.set_slot_weights(pool.gate_up_ptrs(l), pool.down_ptrs(l));   // before the next forward is enqueued
//
// begin_layer: the layer's transfers from eplb::plan_migration (each changed slot received once, local copies
// first); reserves one free buffer per incoming slot (SlotBufferMap::reserve, consecutive when possible);
// enqueues the local copies on the migration's own stream and ONE NCCL group (sends from the live buffers,
// recvs into the reserved ones) on the migration communicator's stream, consecutive buffers merged into one
// op per tensor where both sides are consecutive (comm::merge_slot_runs: one host message each way per peer).
// Staging is at most one layer: begin_layer while a layer is in flight is an error.
// NOTES: a freed buffer may still be read by forward work queued before its commit. commit(reader_stream)
// records an event there; a later begin_layer that reserves that buffer makes its copies and its NCCL group
// wait for the event on the device (no host wait). reader_stream null: the caller guarantees no queued reader.
// NOTES: old_row must describe what the pool holds (it is the caller's live placement row); the migration
// moves bytes by its plan and cannot see logical expert ids.
// This header includes no CUDA header.
#include <cstdint>
#include <deque>
#include <span>
#include <utility>
#include <vector>

#include "gpu/moe/gpu_slot_pool.hpp"
#include "comm/nccl_communicator.hpp"
#include "eplb/topology.hpp"

struct CUstream_st;  // cudaStream_t
struct CUevent_st;   // cudaEvent_t

namespace fulcrum::comm {

struct SlotPoolMigrationStats {
  int64_t num_layers_committed = 0;
  int64_t num_local_copies = 0;  // slots this rank filled from its own slots
  int64_t num_received = 0;      // slots received from peers
  int64_t num_sent = 0;          // slots sent to peers
  int64_t num_nccl_ops = 0;      // ncclSend + ncclRecv issued (after merging runs)
};

class NcclSlotPoolMigration {
 public:
  // `migration_comm`: this EP rank's communicator dedicated to migration (its ranks are the EP ranks);
  // `topology`: num_gpus == its size, slots_per_gpu() == the pool's slots_per_layer. Pool and communicator
  // must outlive the migration; the pool's device must be current.
  NcclSlotPoolMigration(backend::GpuSlotPool& pool, NcclCommunicator& migration_comm, const eplb::Topology& topology);
  ~NcclSlotPoolMigration();
  NcclSlotPoolMigration(const NcclSlotPoolMigration&) = delete;
  NcclSlotPoolMigration& operator=(const NcclSlotPoolMigration&) = delete;

  // Collective (every EP rank, same layer, same rows): old_row / new_row are the layer's global
  // physical_to_logical rows [P] (eplb::Placement::layer). Returns once everything is enqueued.
  // A row without changes enqueues nothing (commit then only ends the layer).
  void begin_layer(int layer_idx, std::span<const int32_t> old_row, std::span<const int32_t> new_row);
  bool in_flight() const { return layer_in_flight_ >= 0; }
  int layer_in_flight() const { return layer_in_flight_; }
  // The layer's copies and transfers are complete (event queries, no host wait). Error when none is in flight.
  bool ready();
  // Waits for the layer's transfer, then remaps its changed slots to the received buffers (the old buffers
  // are free once `reader_stream`'s work queued so far is done). Not collective. Returns the layer's index.
  int commit(CUstream_st* reader_stream);

  const SlotPoolMigrationStats& stats() const { return stats_; }

 private:
  // Makes stream_ wait on the device for every commit's readers that may still read one of `buffers`, and
  // returns an event on stream_ after those waits (null: nothing to wait for).
  CUevent_st* wait_for_readers_of(std::span<const int32_t> buffers);
  void abandon();  // drops the layer in flight (after a failure): its reservations go back

  backend::GpuSlotPool& pool_;
  NcclCommunicator& comm_;
  eplb::Topology topology_;
  CUstream_st* stream_ = nullptr;      // local copies
  CUevent_st* copies_done_ = nullptr;  // recorded on stream_ after the layer's local copies
  CUevent_st* readers_done_ = nullptr;  // recorded on stream_ after the waits for freed buffers' readers

  int layer_in_flight_ = -1;
  NcclCommunicator::PendingExchange exchange_;
  std::vector<std::pair<int, int32_t>> incoming_;  // (local slot, reserved buffer) of the layer in flight

  // Release events of committed layers, oldest first: (commit number, event on the reader stream).
  std::deque<std::pair<int64_t, CUevent_st*>> release_events_;
  std::vector<int64_t> freed_at_;  // [buffers]: commit number that freed the buffer; 0: never live since
  int64_t num_commits_ = 0;
  SlotPoolMigrationStats stats_;
};

}  // namespace fulcrum::comm
