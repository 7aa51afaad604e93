#pragma once
// Device storage of the GPU MoE layers' expert slots (bf16), addressed through an eplb_runtime::SlotBufferMap so
// a live migration receives into free buffers and commits by remapping pointers (no weight copy).
//
// Layout: ONE allocation per tensor kind, buffers contiguous in index order:
//   gate_up [N, 2I, H] bf16 (gate rows, then up rows), N * 2I * H * 2 bytes
//   down    [N, H, I]  bf16,                            N * H * I * 2 bytes
// N = num_layers * slots_per_layer + spare (SlotBufferMap). So buffers b and b + 1 are adjacent in both
// tensors and a run of consecutive buffers moves as one NCCL op per tensor.
// GpuMoeLayer::set_slot_weights takes gate_up_ptrs(layer) / down_ptrs(layer).
// Uploads and fills are synchronous (setup work; they return when the device holds the values); they write
// live buffers, so never while a migration of that layer is in flight.
// This header includes no CUDA header.
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "gpu/moe/moe_layer.hpp"
#include "eplb_runtime/slot_buffer_map.hpp"

struct CUstream_st;  // cudaStream_t

namespace fulcrum::backend {

struct SlotPoolShape {
  int num_layers = 0;
  int slots_per_layer = 0;        // local slots of each layer on this GPU (P / G)
  int hidden_size = 0;            // H
  int moe_intermediate_size = 0;  // I
  int spare = -1;                 // free buffers; < 0: slots_per_layer (staging of one layer)
};

class GpuSlotPool {
 public:
  // Allocates on device `device_idx` (made current for the calls that follow).
  GpuSlotPool(const SlotPoolShape& shape, int device_idx = 0);
  ~GpuSlotPool();
  GpuSlotPool(const GpuSlotPool&) = delete;
  GpuSlotPool& operator=(const GpuSlotPool&) = delete;

  const SlotPoolShape& shape() const { return shape_; }
  int device_idx() const { return device_idx_; }
  eplb_runtime::SlotBufferMap& map() { return map_; }
  const eplb_runtime::SlotBufferMap& map() const { return map_; }

  int64_t gate_up_elems() const { return 2 * int64_t{shape_.moe_intermediate_size} * shape_.hidden_size; }  // 2I * H
  int64_t down_elems() const { return int64_t{shape_.hidden_size} * shape_.moe_intermediate_size; }         // H * I
  int64_t slot_bytes() const { return 2 * (gate_up_elems() + down_elems()); }

  // Device addresses of one buffer's tensors.
  uint16_t* gate_up_buffer(int32_t buffer) const;  // [2I, H]
  uint16_t* down_buffer(int32_t buffer) const;     // [H, I]

  // One device pointer per local slot of the layer, as GpuMoeLayer::set_slot_weights takes them; valid until
  // the layer's next commit.
  std::vector<const uint16_t*> gate_up_ptrs(int layer_idx) const;
  std::vector<const uint16_t*> down_ptrs(int layer_idx) const;

  // Host bf16 weights of all the layer's local slots: gate_up [S, 2I, H], down [S, H, I].
  void upload_layer(int layer_idx, std::span<const uint16_t> gate_up, std::span<const uint16_t> down);
  // Fills each local slot s of the layer with the generated weights of logical expert experts[s]
  // (model::expert_weights_reference(seed, layer_idx, experts[s], ...)), on the device.
  void fill_layer(int layer_idx, std::span<const int32_t> experts, uint64_t seed);
  // Host copy of one buffer: (gate_up [2I * H], down [H * I]).
  std::pair<std::vector<uint16_t>, std::vector<uint16_t>> download_buffer(int32_t buffer) const;
  // Host copy of the layer's local slot (through the map).
  std::pair<std::vector<uint16_t>, std::vector<uint16_t>> download_slot(int layer_idx, int local_slot) const;

 private:
  void check_layer(int layer_idx) const;

  SlotPoolShape shape_;
  int device_idx_ = 0;
  eplb_runtime::SlotBufferMap map_;
  DeviceBuffer gate_up_;  // [N, 2I, H]
  DeviceBuffer down_;     // [N, H, I]
  CUstream_st* stream_ = nullptr;  // uploads and fills
};

}  // namespace fulcrum::backend
