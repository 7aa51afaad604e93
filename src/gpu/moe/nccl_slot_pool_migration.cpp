#include "gpu/moe/nccl_slot_pool_migration.hpp"

#include <cuda_runtime.h>

#include <algorithm>

#include <fmt/format.h>

#include "backend/cuda/cuda_check.hpp"
#include "comm/slot_runs.hpp"
#include "eplb/error.hpp"
#include "eplb/migration_plan.hpp"
#include "eplb/placement.hpp"

namespace fulcrum::comm {

NcclSlotPoolMigration::NcclSlotPoolMigration(backend::GpuSlotPool& pool, NcclCommunicator& migration_comm,
                                             const eplb::Topology& topology)
    : pool_(pool), comm_(migration_comm), topology_(topology) {
  FULCRUM_CHECK(topology.num_gpus == migration_comm.size() && topology.num_gpus > 0 &&
                    topology.num_physical_experts % topology.num_gpus == 0 &&
                    topology.slots_per_gpu() == pool.shape().slots_per_layer,
                "slot pool migration: topology of {} slots on {} GPUs, the communicator has {} ranks and the pool {} "
                "slots per layer",
                topology.num_physical_experts, topology.num_gpus, migration_comm.size(), pool.shape().slots_per_layer);
  freed_at_.assign(static_cast<size_t>(pool.map().num_buffers()), 0);
  FULCRUM_CUDA_CHECK(cudaSetDevice(pool.device_idx()));
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  FULCRUM_CUDA_CHECK(cudaEventCreateWithFlags(&copies_done_, cudaEventDisableTiming));
  FULCRUM_CUDA_CHECK(cudaEventCreateWithFlags(&readers_done_, cudaEventDisableTiming));
}

NcclSlotPoolMigration::~NcclSlotPoolMigration() {
  if (in_flight()) {
    try {
      exchange_.wait();  // NCCL still writes the reserved buffers; a dead peer ends the wait
    } catch (...) {
    }
  }
  cudaStreamSynchronize(stream_);
  if (in_flight()) {  // the pool outlives this migration: the layer's reserved buffers go back
    try {
      pool_.map().release_reserved(layer_in_flight_);
    } catch (...) {
    }
  }
  for (const auto& [commit, event] : release_events_) cudaEventDestroy(event);
  cudaEventDestroy(copies_done_);
  cudaEventDestroy(readers_done_);
  cudaStreamDestroy(stream_);
}

CUevent_st* NcclSlotPoolMigration::wait_for_readers_of(std::span<const int32_t> buffers) {
  while (!release_events_.empty() && cudaEventQuery(release_events_.front().second) == cudaSuccess) {
    FULCRUM_CUDA_CHECK(cudaEventDestroy(release_events_.front().second));
    release_events_.pop_front();
  }
  // Each layer's commit records its event on that layer's reader stream, so every freeing commit among the
  // buffers needs its own wait (a later commit's event on another stream does not cover an earlier reader).
  bool waited = false;
  for (const auto& [commit, event] : release_events_) {
    const bool freed_here = std::any_of(buffers.begin(), buffers.end(),
                                        [&](int32_t b) { return freed_at_[static_cast<size_t>(b)] == commit; });
    if (!freed_here) continue;
    FULCRUM_CUDA_CHECK(cudaStreamWaitEvent(stream_, event, 0));
    waited = true;
  }
  if (!waited) return nullptr;  // no reader left (events pruned) or the commits named none
  FULCRUM_CUDA_CHECK(cudaEventRecord(readers_done_, stream_));
  return readers_done_;
}

void NcclSlotPoolMigration::begin_layer(int layer_idx, std::span<const int32_t> old_row,
                                        std::span<const int32_t> new_row) {
  FULCRUM_CHECK(!in_flight(), "slot pool migration: begin_layer({}) while layer {} is in flight (staging holds one layer)",
                layer_idx, layer_in_flight_);
  FULCRUM_CHECK(layer_idx >= 0 && layer_idx < pool_.shape().num_layers, "slot pool migration: layer {} outside [0, {})",
                layer_idx, pool_.shape().num_layers);
  const std::vector<eplb::SlotTransfer> transfers = backend::plan_layer_transfers(topology_, layer_idx, old_row, new_row);
  const int rank = comm_.rank();
  const int first_slot = rank * topology_.slots_per_gpu();
  eplb_runtime::SlotBufferMap& map = pool_.map();

  // Incoming transfers in posting order: received ones grouped by source rank (plan order within, as the
  // sources post their sends), then local copies; reserved buffers are assigned in that order.
  std::vector<const eplb::SlotTransfer*> incoming;
  for (const auto& t : transfers) {
    if (topology_.gpu_of_slot(t.dst_slot) == rank) incoming.push_back(&t);
  }
  std::stable_sort(incoming.begin(), incoming.end(), [&](const eplb::SlotTransfer* a, const eplb::SlotTransfer* b) {
    const auto key = [&](const eplb::SlotTransfer* t) {
      const int src = topology_.gpu_of_slot(t->src_slot);
      return src == rank ? comm_.size() : src;
    };
    return key(a) < key(b);
  });
  const std::vector<int32_t> reserved = map.reserve(layer_idx, static_cast<int>(incoming.size()));
  const auto bytes_of_buffer = [this](int32_t b, bool gate_up) {
    return gate_up ? pool_.gate_up_blob(b) : pool_.down_blob(b);  // weights and, FP8, their scales
  };
  const int64_t gate_up_bytes = pool_.gate_up_blob_bytes(), down_bytes = pool_.down_blob_bytes();
  try {
    CUevent_st* start_after = wait_for_readers_of(reserved);  // the local copies below wait too (stream_)
    std::vector<SlotRunItem> sends, recvs;
    std::vector<std::pair<int, int32_t>> assigned;
    int64_t num_local = 0;
    for (size_t j = 0; j < incoming.size(); ++j) {
      const eplb::SlotTransfer& t = *incoming[j];
      const int32_t dst = reserved[j];
      assigned.emplace_back(t.dst_slot - first_slot, dst);
      const int src_rank = topology_.gpu_of_slot(t.src_slot);
      if (src_rank != rank) {
        recvs.push_back({src_rank, dst, bytes_of_buffer(dst, true), bytes_of_buffer(dst, false)});
        continue;
      }
      pool_.copy_buffer_async(dst, map.buffer_of(layer_idx, t.src_slot - first_slot), stream_);
      ++num_local;
    }
    FULCRUM_CUDA_CHECK(cudaEventRecord(copies_done_, stream_));
    for (const auto& t : transfers) {
      const int dst_rank = topology_.gpu_of_slot(t.dst_slot);
      if (topology_.gpu_of_slot(t.src_slot) != rank || dst_rank == rank) continue;
      const int32_t src = map.buffer_of(layer_idx, t.src_slot - first_slot);
      sends.push_back({dst_rank, src, bytes_of_buffer(src, true), bytes_of_buffer(src, false)});
    }
    const SlotRunOps ops = merge_slot_runs(comm_, sends, recvs, gate_up_bytes, down_bytes);
    exchange_ = comm_.exchange_device_async(ops.sends, ops.recvs, start_after);
    incoming_ = std::move(assigned);
    layer_in_flight_ = layer_idx;
    stats_.num_local_copies += num_local;
    stats_.num_sent += static_cast<int64_t>(sends.size());
    stats_.num_received += static_cast<int64_t>(recvs.size());
    stats_.num_nccl_ops += static_cast<int64_t>(ops.sends.size() + ops.recvs.size());
  } catch (...) {
    cudaStreamSynchronize(stream_);  // no local copy still writes a buffer that goes back to the free list
    map.release_reserved(layer_idx);
    throw;
  }
}

bool NcclSlotPoolMigration::ready() {
  FULCRUM_CHECK(in_flight(), "slot pool migration: ready() with no layer in flight (call begin_layer first)");
  const cudaError_t copies = cudaEventQuery(copies_done_);
  if (copies != cudaSuccess && copies != cudaErrorNotReady) FULCRUM_CUDA_CHECK(copies);
  return exchange_.ready() && copies == cudaSuccess;
}

void NcclSlotPoolMigration::abandon() {
  cudaStreamSynchronize(stream_);
  pool_.map().release_reserved(layer_in_flight_);
  incoming_.clear();
  exchange_ = {};
  layer_in_flight_ = -1;
}

int NcclSlotPoolMigration::commit(CUstream_st* reader_stream) {
  FULCRUM_CHECK(in_flight(), "slot pool migration: commit without begin_layer (no layer in flight)");
  try {
    exchange_.wait();
    FULCRUM_CUDA_CHECK(cudaEventSynchronize(copies_done_));
  } catch (...) {
    abandon();
    throw;
  }
  const int layer_idx = layer_in_flight_;
  ++num_commits_;
  for (const auto& [local_slot, buffer] : incoming_) {
    const int32_t old = pool_.map().remap(layer_idx, local_slot, buffer);
    freed_at_[static_cast<size_t>(old)] = num_commits_;
  }
  if (reader_stream != nullptr && !incoming_.empty()) {
    CUevent_st* event = nullptr;
    FULCRUM_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    release_events_.emplace_back(num_commits_, event);
    FULCRUM_CUDA_CHECK(cudaEventRecord(event, reader_stream));
  }
  incoming_.clear();
  exchange_ = {};
  layer_in_flight_ = -1;
  ++stats_.num_layers_committed;
  return layer_idx;
}

}  // namespace fulcrum::comm
