#pragma once
// Slot migration between GPU ranks (the CUDA backend's tensors are device memory): slots never leave the
// GPU. Staging is device tensors for the layer's incoming slots (SlotStaging, at most one layer); local
// copies are cudaMemcpyAsync on the executor's own side stream; sends and recvs are deferred and issued in
// wait() as one NCCL group of ncclSend/ncclRecv on device pointers (NcclCommunicator::exchange_device, on
// the communicator's stream, with its abort-on-failure handling), overlapping the local copies.
// Consecutive slots that are contiguous on both sides go as one op per tensor (comm::merge_slot_runs, one host
// message each way per pair).
// Ordering with the backend's compute stream: begin_layer waits for the backend (no kernel still reads a
// slot a commit rewrites); end_layer waits for the commits (the next forward pass reads them).
// This header includes no CUDA header.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_backend.hpp"
#include "comm/nccl_communicator.hpp"
#include "comm/slot_runs.hpp"
#include "eplb_runtime/slot_copy_executor.hpp"

struct CUstream_st;  // cudaStream_t

namespace fulcrum::comm {

class NcclSlotCopyExecutor final : public eplb_runtime::SlotCopyExecutor {
 public:
  // `ep_comm`'s ranks are the EP ranks; both must outlive the executor.
  NcclSlotCopyExecutor(backend::CudaBackend& backend, NcclCommunicator& ep_comm);
  ~NcclSlotCopyExecutor() override;
  NcclSlotCopyExecutor(const NcclSlotCopyExecutor&) = delete;
  NcclSlotCopyExecutor& operator=(const NcclSlotCopyExecutor&) = delete;

  void begin_layer(const model::ExpertSlotView& view, int num_staging_slots) override;
  void copy_local(const model::ExpertSlotView& view, int src_local_slot, int staging_idx) override;
  void send(const model::ExpertSlotView& view, int src_local_slot, int dst_rank) override;
  void recv(const model::ExpertSlotView& view, int staging_idx, int src_rank) override;
  void wait() override;
  void commit_slot(const model::ExpertSlotView& view, int staging_idx, int dst_local_slot) override;
  void end_layer() override;
  int64_t peak_staging_bytes() const override { return staging_.peak_bytes(); }

 private:
  // dst <- src (same element count) on the side stream.
  void copy_async(const model::Tensor& dst, const model::Tensor& src);

  backend::CudaBackend& backend_;
  NcclCommunicator& ep_comm_;
  eplb_runtime::SlotStaging staging_;
  CUstream_st* stream_ = nullptr;
  void issue();

  // This layer's pending sends and recvs (index: local slot or staging entry), issued in wait().
  std::vector<SlotRunItem> sends_;
  std::vector<SlotRunItem> recvs_;
  int64_t gate_up_bytes_ = 0;  // of one slot, this layer
  int64_t down_bytes_ = 0;
};

}  // namespace fulcrum::comm
