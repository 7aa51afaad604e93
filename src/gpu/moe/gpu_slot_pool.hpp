#pragma once
// Device storage of the GPU MoE layers' expert slots (bf16 or FP8), addressed through an
// eplb_runtime::SlotBufferMap so a live migration receives into free buffers and commits by remapping pointers
// (no weight copy).
//
// Layout: ONE allocation per tensor kind, buffers contiguous in index order, each buffer one blob:
//   bf16: gate_up [N][2I, H] bf16 (gate rows, then up rows); down [N][H, I] bf16
//   fp8:  gate_up [N][codes e4m3 [2I, H] | scales fp32 [H/128][2I/128]]; down [N][codes [H, I] | scales
//         [I/128][H/128]], each blob padded to 256 bytes (the FP8 grouped GEMM's weight and scale layout,
//         gpu/cutlass/grouped_gemm_fp8.hpp; needs H and I multiples of 128: the engine pads I)
// N = num_layers * slots_per_layer + spare (SlotBufferMap). So buffers b and b + 1 are adjacent in both
// tensors and a run of consecutive buffers moves as one NCCL op per tensor. A slot's scales live inside its
// blob: whatever moves, copies or caches a slot moves its scales with its weights (the EPLB bug of the big
// servers — scales left behind after a rebalance — cannot be written against this layout).
// GpuMoeLayer::set_slot_weights takes gate_up_ptrs(layer) / down_ptrs(layer) (bf16) or fp8_ptrs(layer).
// Uploads and fills are synchronous (setup work; they return when the device holds the values); they write
// live buffers, so never while a migration of that layer is in flight.
// This header includes no CUDA header.
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "comm/device_exchange.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "eplb/migration_plan.hpp"
#include "eplb/topology.hpp"
#include "eplb_runtime/slot_buffer_map.hpp"

struct CUstream_st;  // cudaStream_t

namespace fulcrum::backend {

struct SlotPoolShape {
  int num_layers = 0;
  int slots_per_layer = 0;        // local slots of each layer on this GPU (P / G)
  int hidden_size = 0;            // H
  int moe_intermediate_size = 0;  // I
  int spare = -1;                 // free buffers; < 0: slots_per_layer (staging of one layer)
  bool fp8 = false;               // e4m3 codes with 128x128 fp32 block scales instead of bf16
};

// One FP8 matrix on the device: e4m3 codes [rows, cols] and fp32 scales [cols / 128][rows / 128].
struct Fp8MatrixPtrs {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
};

// Per local slot of a layer, as GpuMoeLayer::set_fp8_slot_weights takes them.
struct Fp8SlotPtrs {
  std::vector<const uint8_t*> gate_up, down;
  std::vector<const float*> gate_up_scales, down_scales;
};

// Bytes of an FP8 blob (codes then scales, padded to 256) of a [rows, cols] matrix; the scales start at
// fp8_scales_offset(rows, cols).
int64_t fp8_blob_bytes(int64_t rows, int64_t cols);
int64_t fp8_scales_offset(int64_t rows, int64_t cols);

// One layer's slot transfers from old_row to new_row (physical slot -> logical expert rows of P = topology's slots,
// eplb::Placement::layer), as eplb::plan_migration plans them: each changed slot received once, local copies first.
// A new-row expert that no old slot holds, a negative id or rows of another length: a one-line error naming the
// layer.
std::vector<eplb::SlotTransfer> plan_layer_transfers(const eplb::Topology& topology, int layer_idx,
                                                     std::span<const int32_t> old_row, std::span<const int32_t> new_row);

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
  bool fp8() const { return shape_.fp8; }
  // Bytes of one buffer's blob of each tensor kind (what migration and copies move per slot).
  int64_t gate_up_blob_bytes() const;
  int64_t down_blob_bytes() const;
  int64_t slot_bytes() const { return gate_up_blob_bytes() + down_blob_bytes(); }

  // Device addresses of one buffer's blobs (either dtype).
  std::byte* gate_up_blob(int32_t buffer) const;
  std::byte* down_blob(int32_t buffer) const;
  // The same as bf16 matrices (a bf16 pool only).
  uint16_t* gate_up_buffer(int32_t buffer) const;  // [2I, H]
  uint16_t* down_buffer(int32_t buffer) const;     // [H, I]
  // The same as FP8 matrices (an fp8 pool only).
  Fp8MatrixPtrs gate_up_fp8(int32_t buffer) const;  // [2I, H]
  Fp8MatrixPtrs down_fp8(int32_t buffer) const;     // [H, I]

  // One device pointer per local slot of the layer, as GpuMoeLayer::set_slot_weights takes them; valid until
  // the layer's next commit.
  std::vector<const uint16_t*> gate_up_ptrs(int layer_idx) const;
  std::vector<const uint16_t*> down_ptrs(int layer_idx) const;
  Fp8SlotPtrs fp8_ptrs(int layer_idx) const;  // an fp8 pool only

  // Enqueues on `stream` the copy of buffer src's blobs (weights and, FP8, their scales) into buffer dst.
  void copy_buffer_async(int32_t dst, int32_t src, CUstream_st* stream) const;
  // Live migration of one layer on a pool that holds all its slots (one GPU): each slot whose expert changes
  // from old_row to new_row (the layer's rows [slots_per_layer]) gets a spare buffer filled by a device copy of a
  // slot that holds the expert now, then is remapped to it (the old buffer goes back to the free list). Returns
  // once the copies are done and the map committed, with the number of slots that moved; the caller makes sure
  // no queued work still reads the old buffers. On an error nothing is remapped.
  int migrate_layer_locally(int layer_idx, std::span<const int32_t> old_row, std::span<const int32_t> new_row);
  // The same for a pool that is one EP rank's part of the layer, collective over `exchange` (its ranks are the EP
  // ranks, rank r holding slots [r S, (r + 1) S) of the rows' P = S x size() slots): every rank plans the same
  // transfers (plan_layer_transfers); a slot whose new expert this rank holds now is filled by a device copy, the
  // others by one all_to_all_v_device of the senders' blobs (weights and FP8 scales together, packed in transfer
  // order), then remapped. Returns the slots this rank received. Every rank calls it with the same rows.
  int migrate_layer_over(comm::DeviceExchange& exchange, int layer_idx, std::span<const int32_t> old_row,
                         std::span<const int32_t> new_row);

  // Host bf16 weights of all the layer's local slots: gate_up [S, 2I, H], down [S, H, I].
  void upload_layer(int layer_idx, std::span<const uint16_t> gate_up, std::span<const uint16_t> down);
  // Host blobs of all the layer's local slots (either dtype): gate_up [S][gate_up_blob_bytes()], down
  // [S][down_blob_bytes()], each in the layout above.
  void upload_layer_blobs(int layer_idx, std::span<const std::byte> gate_up, std::span<const std::byte> down);
  // Fills each local slot s of the layer with the generated weights of logical expert experts[s], on the
  // device: bf16 model::expert_weights_reference(seed, layer_idx, experts[s], ...); fp8 codes
  // model::random_e4m3_reference of the same seeds and every block scale model::expert_fp8_block_scale.
  void fill_layer(int layer_idx, std::span<const int32_t> experts, uint64_t seed);
  // Host copy of one buffer, bf16 pool: (gate_up [2I * H], down [H * I]).
  std::pair<std::vector<uint16_t>, std::vector<uint16_t>> download_buffer(int32_t buffer) const;
  // Host copy of the layer's local slot (through the map), bf16 pool.
  std::pair<std::vector<uint16_t>, std::vector<uint16_t>> download_slot(int layer_idx, int local_slot) const;
  // Host copy of one buffer's blobs, either dtype: (gate_up blob, down blob).
  std::pair<std::vector<std::byte>, std::vector<std::byte>> download_blobs(int32_t buffer) const;

 private:
  void check_layer(int layer_idx) const;
  void check_buffer(int32_t buffer) const;

  SlotPoolShape shape_;
  int device_idx_ = 0;
  eplb_runtime::SlotBufferMap map_;
  DeviceBuffer gate_up_;  // [N][gate_up blob]
  DeviceBuffer down_;     // [N][down blob]
  CUstream_st* stream_ = nullptr;  // uploads and fills
};

}  // namespace fulcrum::backend
