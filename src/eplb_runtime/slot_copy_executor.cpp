#include "eplb_runtime/slot_copy_executor.hpp"

#include <algorithm>

namespace fulcrum::eplb_runtime {

int64_t slot_bytes(const model::ExpertSlotView& view) {
  return (view.gate_up.row_numel() + view.down.row_numel()) * static_cast<int64_t>(sizeof(float));
}

void SlotStaging::prepare(model::Backend& backend, const model::ExpertSlotView& view, int num_staging_slots) {
  FULCRUM_CHECK(num_staging_slots >= 0 && num_staging_slots <= view.num_slots,
                "slot migration: layer {} stages {} slots, the rank holds {}", view.layer_idx, num_staging_slots,
                view.num_slots);
  num_slots_ = num_staging_slots;
  if (num_staging_slots == 0) return;
  const auto& gate_up_shape = view.gate_up.shape();
  const auto& down_shape = view.down.shape();
  const bool fits = gate_up_.rank() == 3 && gate_up_.dim(0) >= num_staging_slots &&
                    gate_up_.dim(1) == gate_up_shape[1] && gate_up_.dim(2) == gate_up_shape[2] &&
                    down_.dim(1) == down_shape[1] && down_.dim(2) == down_shape[2];
  if (fits) return;
  gate_up_ = model::Tensor();  // free the old buffer before allocating the new one
  down_ = model::Tensor();
  gate_up_ = backend.zeros({num_staging_slots, gate_up_shape[1], gate_up_shape[2]});
  down_ = backend.zeros({num_staging_slots, down_shape[1], down_shape[2]});
  peak_bytes_ = std::max(peak_bytes_, num_staging_slots * slot_bytes(view));
}

void SlotStaging::check_idx(int staging_idx) const {
  FULCRUM_CHECK(staging_idx >= 0 && staging_idx < num_slots_, "slot migration: staging entry {} outside [0, {})",
                staging_idx, num_slots_);
}

BackendSlotCopyExecutor::BackendSlotCopyExecutor(model::Backend& backend, comm::Communicator& ep_comm)
    : backend_(backend), ep_comm_(ep_comm) {}

void BackendSlotCopyExecutor::begin_layer(const model::ExpertSlotView& view, int num_staging_slots) {
  staging_.prepare(backend_, view, num_staging_slots);
}

void BackendSlotCopyExecutor::copy_local(const model::ExpertSlotView& view, int src_local_slot, int staging_idx) {
  staging_.check_idx(staging_idx);
  backend_.copy(staging_.gate_up().index(staging_idx), view.gate_up.index(src_local_slot));
  backend_.copy(staging_.down().index(staging_idx), view.down.index(src_local_slot));
}

void BackendSlotCopyExecutor::send(const model::ExpertSlotView& view, int src_local_slot, int dst_rank) {
  std::vector<float> message = backend_.download(view.gate_up.index(src_local_slot));
  const std::vector<float> down = backend_.download(view.down.index(src_local_slot));
  message.insert(message.end(), down.begin(), down.end());
  ep_comm_.send(comm::bytes_of(std::span<const float>(message)), dst_rank);
}

void BackendSlotCopyExecutor::recv(const model::ExpertSlotView& view, int staging_idx, int src_rank) {
  staging_.check_idx(staging_idx);
  const int64_t gate_up_numel = view.gate_up.row_numel();
  std::vector<float> message(static_cast<size_t>(gate_up_numel + view.down.row_numel()));
  ep_comm_.recv(comm::writable_bytes_of(std::span<float>(message)), src_rank);
  const std::span<const float> all(message);
  backend_.upload(staging_.gate_up().index(staging_idx), all.first(static_cast<size_t>(gate_up_numel)));
  backend_.upload(staging_.down().index(staging_idx), all.subspan(static_cast<size_t>(gate_up_numel)));
}

void BackendSlotCopyExecutor::commit_slot(const model::ExpertSlotView& view, int staging_idx, int dst_local_slot) {
  staging_.check_idx(staging_idx);
  backend_.copy(view.gate_up.index(dst_local_slot), staging_.gate_up().index(staging_idx));
  backend_.copy(view.down.index(dst_local_slot), staging_.down().index(staging_idx));
}

}  // namespace fulcrum::eplb_runtime
