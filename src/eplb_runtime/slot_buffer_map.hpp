#pragma once
// Which storage buffer holds each expert slot, for a migration that commits by remapping pointers instead of
// copying weights (backend::GpuSlotPool holds the buffers, comm::NcclSlotPoolMigration moves them).
//
// Buffers 0..N-1, N = num_layers * slots_per_layer + spare. Initially slot s of layer l is buffer
// l * slots_per_layer + s and the spare buffers are free. A layer's migration reserves free buffers for its
// incoming slots, fills them while the old buffers stay live, then remaps each changed slot to its new buffer;
// the old buffer goes back to the free list. So the total stays N: spare = slots_per_layer (the default) is
// "staging of at most one layer".
// NOTES: a buffer is in exactly one state: live (held by one (layer, slot)), free, or reserved for one layer.
// NOTES: every misuse is a one-line fulcrum::Error naming the layer, slot or buffer; a failed call changes
// nothing.
#include <cstdint>
#include <span>
#include <vector>

namespace fulcrum::eplb_runtime {

class SlotBufferMap {
 public:
  // spare < 0: slots_per_layer (one layer of staging).
  SlotBufferMap(int num_layers, int slots_per_layer, int spare = -1);

  int num_layers() const { return num_layers_; }
  int slots_per_layer() const { return slots_per_layer_; }
  int num_buffers() const { return static_cast<int>(state_.size()); }
  int num_free() const { return static_cast<int>(free_.size()); }

  int buffer_of(int layer_idx, int local_slot) const;
  // The layer's buffers, one per local slot [slots_per_layer].
  std::span<const int32_t> layer_buffers(int layer_idx) const;
  // Free buffers, ascending.
  const std::vector<int32_t>& free_buffers() const { return free_; }

  // Takes `count` free buffers for the layer's incoming slots, ascending: the lowest run of `count`
  // consecutive free buffers when there is one (consecutive buffers are contiguous in the pool, so the
  // transfers into them merge into one NCCL op per tensor), else the lowest free buffers.
  // Error when fewer than `count` are free or the layer already holds a reservation.
  std::vector<int32_t> reserve(int layer_idx, int count);
  // Buffers reserved for the layer and not yet remapped, ascending.
  std::vector<int32_t> reserved(int layer_idx) const;
  // Commit of one slot: (layer, local_slot) now lives in `buffer`, which must be reserved for that layer;
  // returns the slot's old buffer, which is free from now on.
  int32_t remap(int layer_idx, int local_slot, int32_t buffer);
  // Returns the layer's remaining reservations to the free list (the end of a commit, or an abandoned
  // migration); returns how many.
  int release_reserved(int layer_idx);

 private:
  void check_layer(int layer_idx) const;
  void check_buffer(int32_t buffer) const;

  static constexpr int32_t kFree = -1;
  // state_[buffer]: kFree, or -2 - layer (reserved for that layer), or layer * slots_per_layer + slot (live).
  static int32_t reserved_state(int layer_idx) { return -2 - layer_idx; }

  int num_layers_ = 0;
  int slots_per_layer_ = 0;
  std::vector<int32_t> buffer_of_;  // [num_layers * slots_per_layer]
  std::vector<int32_t> state_;      // [N]
  std::vector<int32_t> free_;       // ascending
};

}  // namespace fulcrum::eplb_runtime
