#include "eplb_runtime/slot_buffer_map.hpp"

#include <algorithm>

#include "eplb/error.hpp"

namespace fulcrum::eplb_runtime {

SlotBufferMap::SlotBufferMap(int num_layers, int slots_per_layer, int spare)
    : num_layers_(num_layers), slots_per_layer_(slots_per_layer) {
  if (spare < 0) spare = slots_per_layer;
  FULCRUM_CHECK(num_layers > 0 && slots_per_layer > 0, "slot buffer map: {} layers of {} slots (both must be positive)",
                num_layers, slots_per_layer);
  const int64_t live = int64_t{num_layers} * slots_per_layer;
  FULCRUM_CHECK(live + spare <= INT32_MAX, "slot buffer map: {} + {} buffers is too many", live, spare);
  buffer_of_.resize(static_cast<size_t>(live));
  state_.resize(static_cast<size_t>(live + spare), kFree);
  for (int32_t b = 0; b < static_cast<int32_t>(live); ++b) {
    buffer_of_[static_cast<size_t>(b)] = b;
    state_[static_cast<size_t>(b)] = b;
  }
  for (int32_t b = static_cast<int32_t>(live); b < static_cast<int32_t>(live + spare); ++b) free_.push_back(b);
}

void SlotBufferMap::check_layer(int layer_idx) const {
  FULCRUM_CHECK(layer_idx >= 0 && layer_idx < num_layers_, "slot buffer map: layer {} outside [0, {})", layer_idx,
                num_layers_);
}

void SlotBufferMap::check_buffer(int32_t buffer) const {
  FULCRUM_CHECK(buffer >= 0 && buffer < num_buffers(), "slot buffer map: buffer {} outside [0, {})", buffer,
                num_buffers());
}

int SlotBufferMap::buffer_of(int layer_idx, int local_slot) const {
  check_layer(layer_idx);
  FULCRUM_CHECK(local_slot >= 0 && local_slot < slots_per_layer_, "slot buffer map: local slot {} outside [0, {})",
                local_slot, slots_per_layer_);
  return buffer_of_[static_cast<size_t>(layer_idx) * slots_per_layer_ + local_slot];
}

std::span<const int32_t> SlotBufferMap::layer_buffers(int layer_idx) const {
  check_layer(layer_idx);
  return std::span<const int32_t>(buffer_of_).subspan(static_cast<size_t>(layer_idx) * slots_per_layer_,
                                                      static_cast<size_t>(slots_per_layer_));
}

std::vector<int32_t> SlotBufferMap::reserve(int layer_idx, int count) {
  check_layer(layer_idx);
  FULCRUM_CHECK(count >= 0, "slot buffer map: reserve of {} buffers", count);
  FULCRUM_CHECK(count <= num_free(), "slot buffer map: layer {} needs {} buffers, only {} of {} are free", layer_idx,
                count, num_free(), num_buffers());
  FULCRUM_CHECK(reserved(layer_idx).empty(), "slot buffer map: layer {} already holds a reservation", layer_idx);
  // The lowest run of `count` consecutive free buffers, else the lowest `count` free buffers.
  size_t first = 0;
  size_t run_begin = 0;
  bool found = count == 0;
  for (size_t i = 0; i < free_.size() && !found; ++i) {
    if (i > 0 && free_[i] != free_[i - 1] + 1) run_begin = i;
    if (i + 1 - run_begin >= static_cast<size_t>(count)) {
      first = run_begin;
      found = true;
    }
  }
  std::vector<int32_t> taken(free_.begin() + static_cast<std::ptrdiff_t>(first),
                             free_.begin() + static_cast<std::ptrdiff_t>(first + count));
  free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(first),
              free_.begin() + static_cast<std::ptrdiff_t>(first + count));
  for (const int32_t b : taken) state_[static_cast<size_t>(b)] = reserved_state(layer_idx);
  return taken;
}

std::vector<int32_t> SlotBufferMap::reserved(int layer_idx) const {
  check_layer(layer_idx);
  std::vector<int32_t> out;
  for (int32_t b = 0; b < num_buffers(); ++b) {
    if (state_[static_cast<size_t>(b)] == reserved_state(layer_idx)) out.push_back(b);
  }
  return out;
}

int32_t SlotBufferMap::remap(int layer_idx, int local_slot, int32_t buffer) {
  const int32_t old = buffer_of(layer_idx, local_slot);  // checks layer and slot
  check_buffer(buffer);
  FULCRUM_CHECK(state_[static_cast<size_t>(buffer)] == reserved_state(layer_idx),
                "slot buffer map: remap of layer {} slot {} to buffer {}, which is not reserved for layer {}", layer_idx,
                local_slot, buffer, layer_idx);
  const int32_t key = layer_idx * slots_per_layer_ + local_slot;
  buffer_of_[static_cast<size_t>(key)] = buffer;
  state_[static_cast<size_t>(buffer)] = key;
  state_[static_cast<size_t>(old)] = kFree;
  free_.insert(std::lower_bound(free_.begin(), free_.end(), old), old);
  return old;
}

int SlotBufferMap::release_reserved(int layer_idx) {
  const std::vector<int32_t> held = reserved(layer_idx);
  for (const int32_t b : held) {
    state_[static_cast<size_t>(b)] = kFree;
    free_.insert(std::lower_bound(free_.begin(), free_.end(), b), b);
  }
  return static_cast<int>(held.size());
}

}  // namespace fulcrum::eplb_runtime
