#pragma once
// Moves expert weights for a slot migration. The migration (slot_migration.hpp) decides what goes
// where; an executor only moves bytes, so a CUDA executor can run the same plan on a side stream with
// NCCL send/recv while the CPU one below uses Backend::download/upload and Communicator::send/recv.
//
// Per layer, on each rank, the migration calls in this order:
//   begin_layer(view, n)       staging for the n slots this rank receives in the layer (n <= view.num_slots)
//   copy_local(...)*           slot of this rank -> staging entry (local copies come first)
//   send(...)* / recv(...)*    slot -> peer rank / peer rank -> staging entry, matched in order per pair;
//                              an executor may defer them and issue them as one group in wait()
//   wait()                     every copy of the layer is complete (a CUDA executor syncs its stream)
//   commit_slot(...)*          staging entry -> live slot (the migration writes physical_to_logical next)
//   end_layer()
// Slots are local to the view: index into view.gate_up / view.down (dim 0).
#include <cstdint>
#include <vector>

#include "comm/communicator.hpp"
#include "model/backend.hpp"
#include "model/qwen3_moe.hpp"

namespace fulcrum::eplb_runtime {

class SlotCopyExecutor {
 public:
  virtual ~SlotCopyExecutor() = default;
  virtual void begin_layer(const model::ExpertSlotView& view, int num_staging_slots) = 0;
  virtual void copy_local(const model::ExpertSlotView& view, int src_local_slot, int staging_idx) = 0;
  virtual void send(const model::ExpertSlotView& view, int src_local_slot, int dst_rank) = 0;
  virtual void recv(const model::ExpertSlotView& view, int staging_idx, int src_rank) = 0;
  virtual void wait() = 0;
  virtual void commit_slot(const model::ExpertSlotView& view, int staging_idx, int dst_local_slot) = 0;
  virtual void end_layer() = 0;
  // Largest staging allocation so far, in bytes.
  virtual int64_t peak_staging_bytes() const = 0;
};

// Bytes of one slot's weights (gate_up and down rows, fp32).
int64_t slot_bytes(const model::ExpertSlotView& view);

// Staging of one layer's incoming slots: two backend tensors sized for the layer (reused while large
// enough, else freed and reallocated), shared by the executors.
class SlotStaging {
 public:
  void prepare(model::Backend& backend, const model::ExpertSlotView& view, int num_staging_slots);
  void check_idx(int staging_idx) const;
  void clear() { num_slots_ = 0; }
  const model::Tensor& gate_up() const { return gate_up_; }
  const model::Tensor& down() const { return down_; }
  int64_t peak_bytes() const { return peak_bytes_; }

 private:
  model::Tensor gate_up_;  // [capacity, 2I, H]
  model::Tensor down_;     // [capacity, H, I]
  int num_slots_ = 0;
  int64_t peak_bytes_ = 0;
};

// Any model::Backend plus a Communicator whose ranks are the EP ranks. Staging is two backend tensors
// sized for the current layer's incoming slots (reused while large enough), so at most one layer's
// slots of this rank are staged at a time. Sends go through host memory (download, then send).
class BackendSlotCopyExecutor final : public SlotCopyExecutor {
 public:
  BackendSlotCopyExecutor(model::Backend& backend, comm::Communicator& ep_comm);

  void begin_layer(const model::ExpertSlotView& view, int num_staging_slots) override;
  void copy_local(const model::ExpertSlotView& view, int src_local_slot, int staging_idx) override;
  void send(const model::ExpertSlotView& view, int src_local_slot, int dst_rank) override;
  void recv(const model::ExpertSlotView& view, int staging_idx, int src_rank) override;
  void wait() override {}
  void commit_slot(const model::ExpertSlotView& view, int staging_idx, int dst_local_slot) override;
  void end_layer() override { staging_.clear(); }
  int64_t peak_staging_bytes() const override { return staging_.peak_bytes(); }

 private:
  model::Backend& backend_;
  comm::Communicator& ep_comm_;
  SlotStaging staging_;
};

}  // namespace fulcrum::eplb_runtime
