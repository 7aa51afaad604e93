#include "gpu/moe/gpu_slot_pool.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "backend/cuda/cuda_check.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "eplb/error.hpp"
#include "eplb/placement.hpp"
#include "model/random_weights.hpp"

namespace fulcrum::backend {

namespace {

constexpr int64_t kFp8Block = 128;
constexpr int64_t kBlobAlignment = 256;

eplb_runtime::SlotBufferMap checked_map(const SlotPoolShape& shape) {
  FULCRUM_CHECK(shape.hidden_size > 0 && shape.moe_intermediate_size > 0,
                "slot pool: hidden {} / intermediate {} must be positive", shape.hidden_size, shape.moe_intermediate_size);
  FULCRUM_CHECK(!shape.fp8 || (shape.hidden_size % kFp8Block == 0 && shape.moe_intermediate_size % kFp8Block == 0),
                "slot pool: FP8 experts need hidden {} and intermediate {} to be multiples of 128 (whole scale blocks)",
                shape.hidden_size, shape.moe_intermediate_size);
  return eplb_runtime::SlotBufferMap(shape.num_layers, shape.slots_per_layer, shape.spare);
}

}  // namespace

std::vector<eplb::SlotTransfer> plan_layer_transfers(const eplb::Topology& topo, int layer_idx,
                                                     std::span<const int32_t> old_row, std::span<const int32_t> new_row) {
  const auto p = static_cast<size_t>(topo.num_physical_experts);
  FULCRUM_CHECK(old_row.size() == p && new_row.size() == p,
                "slot pool migration: layer {}: rows of {} and {} slots, the topology has {}", layer_idx,
                old_row.size(), new_row.size(), p);
  int32_t max_expert = 0;
  for (const auto row : {old_row, new_row}) {
    for (const int32_t e : row) {
      FULCRUM_CHECK(e >= 0, "slot pool migration: layer {}: logical expert {} in a row", layer_idx, e);
      max_expert = std::max(max_expert, e);
    }
  }
  // Every expert of the new row needs a source in the old one.
  std::vector<uint8_t> held(static_cast<size_t>(max_expert) + 1, 0);
  for (const int32_t e : old_row) held[static_cast<size_t>(e)] = 1;
  for (size_t slot = 0; slot < p; ++slot) {
    FULCRUM_CHECK(held[static_cast<size_t>(new_row[slot])] != 0,
                  "slot pool migration: layer {}: new row slot {} holds logical expert {}, which no slot of the old row "
                  "holds",
                  layer_idx, slot, new_row[slot]);
  }
  eplb::Placement from(topo, 1, max_expert + 1);
  eplb::Placement to(topo, 1, max_expert + 1);
  std::copy(old_row.begin(), old_row.end(), from.layer(0).begin());
  std::copy(new_row.begin(), new_row.end(), to.layer(0).begin());
  try {
    from.validate();  // ids in range, every expert held (plan_migration assumes both)
    to.validate();
    return eplb::plan_migration(from, to).transfers;
  } catch (const Error& e) {
    throw Error(fmt::format("slot pool migration: layer {}: {}", layer_idx, e.what()));
  }
}

int64_t fp8_scales_offset(int64_t rows, int64_t cols) { return (rows * cols + 15) / 16 * 16; }

int64_t fp8_blob_bytes(int64_t rows, int64_t cols) {
  const int64_t scales = ((rows + kFp8Block - 1) / kFp8Block) * ((cols + kFp8Block - 1) / kFp8Block) * 4;
  return (fp8_scales_offset(rows, cols) + scales + kBlobAlignment - 1) / kBlobAlignment * kBlobAlignment;
}

int64_t GpuSlotPool::gate_up_blob_bytes() const {
  return shape_.fp8 ? fp8_blob_bytes(2 * int64_t{shape_.moe_intermediate_size}, shape_.hidden_size) : gate_up_elems() * 2;
}

int64_t GpuSlotPool::down_blob_bytes() const {
  return shape_.fp8 ? fp8_blob_bytes(shape_.hidden_size, shape_.moe_intermediate_size) : down_elems() * 2;
}

GpuSlotPool::GpuSlotPool(const SlotPoolShape& shape, int device_idx)
    : shape_(shape), device_idx_(device_idx), map_(checked_map(shape)) {
  shape_.spare = map_.num_buffers() - shape.num_layers * shape.slots_per_layer;
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx));
  const auto buffers = static_cast<size_t>(map_.num_buffers());
  gate_up_ = DeviceBuffer(buffers * static_cast<size_t>(gate_up_blob_bytes()));
  down_ = DeviceBuffer(buffers * static_cast<size_t>(down_blob_bytes()));
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

GpuSlotPool::~GpuSlotPool() {
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

void GpuSlotPool::check_layer(int layer_idx) const {
  FULCRUM_CHECK(layer_idx >= 0 && layer_idx < shape_.num_layers, "slot pool: layer {} outside [0, {})", layer_idx,
                shape_.num_layers);
}

void GpuSlotPool::check_buffer(int32_t buffer) const {
  FULCRUM_CHECK(buffer >= 0 && buffer < map_.num_buffers(), "slot pool: buffer {} outside [0, {})", buffer,
                map_.num_buffers());
}

std::byte* GpuSlotPool::gate_up_blob(int32_t buffer) const {
  check_buffer(buffer);
  return gate_up_.as<std::byte>() + static_cast<size_t>(buffer) * static_cast<size_t>(gate_up_blob_bytes());
}

std::byte* GpuSlotPool::down_blob(int32_t buffer) const {
  check_buffer(buffer);
  return down_.as<std::byte>() + static_cast<size_t>(buffer) * static_cast<size_t>(down_blob_bytes());
}

uint16_t* GpuSlotPool::gate_up_buffer(int32_t buffer) const {
  FULCRUM_CHECK(!shape_.fp8, "slot pool: bf16 view of an FP8 pool");
  return reinterpret_cast<uint16_t*>(gate_up_blob(buffer));
}

uint16_t* GpuSlotPool::down_buffer(int32_t buffer) const {
  FULCRUM_CHECK(!shape_.fp8, "slot pool: bf16 view of an FP8 pool");
  return reinterpret_cast<uint16_t*>(down_blob(buffer));
}

Fp8MatrixPtrs GpuSlotPool::gate_up_fp8(int32_t buffer) const {
  FULCRUM_CHECK(shape_.fp8, "slot pool: FP8 view of a bf16 pool");
  const std::byte* blob = gate_up_blob(buffer);
  const int64_t rows = 2 * int64_t{shape_.moe_intermediate_size}, cols = shape_.hidden_size;
  return {reinterpret_cast<const uint8_t*>(blob), reinterpret_cast<const float*>(blob + fp8_scales_offset(rows, cols))};
}

Fp8MatrixPtrs GpuSlotPool::down_fp8(int32_t buffer) const {
  FULCRUM_CHECK(shape_.fp8, "slot pool: FP8 view of a bf16 pool");
  const std::byte* blob = down_blob(buffer);
  const int64_t rows = shape_.hidden_size, cols = shape_.moe_intermediate_size;
  return {reinterpret_cast<const uint8_t*>(blob), reinterpret_cast<const float*>(blob + fp8_scales_offset(rows, cols))};
}

std::vector<const uint16_t*> GpuSlotPool::gate_up_ptrs(int layer_idx) const {
  std::vector<const uint16_t*> ptrs;
  for (const int32_t b : map_.layer_buffers(layer_idx)) ptrs.push_back(gate_up_buffer(b));
  return ptrs;
}

std::vector<const uint16_t*> GpuSlotPool::down_ptrs(int layer_idx) const {
  std::vector<const uint16_t*> ptrs;
  for (const int32_t b : map_.layer_buffers(layer_idx)) ptrs.push_back(down_buffer(b));
  return ptrs;
}

Fp8SlotPtrs GpuSlotPool::fp8_ptrs(int layer_idx) const {
  Fp8SlotPtrs ptrs;
  for (const int32_t b : map_.layer_buffers(layer_idx)) {
    const Fp8MatrixPtrs gu = gate_up_fp8(b), dn = down_fp8(b);
    ptrs.gate_up.push_back(gu.codes);
    ptrs.gate_up_scales.push_back(gu.scales);
    ptrs.down.push_back(dn.codes);
    ptrs.down_scales.push_back(dn.scales);
  }
  return ptrs;
}

void GpuSlotPool::upload_layer_blobs(int layer_idx, std::span<const std::byte> gate_up, std::span<const std::byte> down) {
  check_layer(layer_idx);
  const int64_t slots = shape_.slots_per_layer, gu = gate_up_blob_bytes(), dn = down_blob_bytes();
  FULCRUM_CHECK(static_cast<int64_t>(gate_up.size()) == slots * gu && static_cast<int64_t>(down.size()) == slots * dn,
                "slot pool: layer {} upload of {} / {} bytes, expected {} x {} / {} x {}", layer_idx, gate_up.size(),
                down.size(), slots, gu, slots, dn);
  for (int s = 0; s < shape_.slots_per_layer; ++s) {
    const int32_t b = map_.buffer_of(layer_idx, s);
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(gate_up_blob(b), gate_up.data() + s * gu, static_cast<size_t>(gu),
                                       cudaMemcpyHostToDevice, stream_));
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(down_blob(b), down.data() + s * dn, static_cast<size_t>(dn),
                                       cudaMemcpyHostToDevice, stream_));
  }
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host spans may go away after return
}

void GpuSlotPool::upload_layer(int layer_idx, std::span<const uint16_t> gate_up, std::span<const uint16_t> down) {
  check_layer(layer_idx);
  FULCRUM_CHECK(!shape_.fp8, "slot pool: bf16 upload into an FP8 pool (upload_layer_blobs)");
  const int64_t slots = shape_.slots_per_layer;
  FULCRUM_CHECK(static_cast<int64_t>(gate_up.size()) == slots * gate_up_elems() &&
                    static_cast<int64_t>(down.size()) == slots * down_elems(),
                "slot pool: layer {} upload of gate_up {} / down {} values, expected {} x {} / {} x {}", layer_idx,
                gate_up.size(), down.size(), slots, gate_up_elems(), slots, down_elems());
  for (int s = 0; s < shape_.slots_per_layer; ++s) {
    const int32_t b = map_.buffer_of(layer_idx, s);
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(gate_up_buffer(b), gate_up.data() + s * gate_up_elems(),
                                       static_cast<size_t>(gate_up_elems()) * 2, cudaMemcpyHostToDevice, stream_));
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(down_buffer(b), down.data() + s * down_elems(),
                                       static_cast<size_t>(down_elems()) * 2, cudaMemcpyHostToDevice, stream_));
  }
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host spans may go away after return
}

void GpuSlotPool::fill_layer(int layer_idx, std::span<const int32_t> experts, uint64_t seed) {
  check_layer(layer_idx);
  FULCRUM_CHECK(static_cast<int>(experts.size()) == shape_.slots_per_layer,
                "slot pool: layer {} fill with {} experts for {} slots", layer_idx, experts.size(),
                shape_.slots_per_layer);
  for (int s = 0; s < shape_.slots_per_layer; ++s) {  // all checked before any fill: no half-filled layer
    FULCRUM_CHECK(experts[static_cast<size_t>(s)] >= 0, "slot pool: layer {} slot {}: logical expert {}", layer_idx, s,
                  experts[static_cast<size_t>(s)]);
  }
  const int h = shape_.hidden_size, i = shape_.moe_intermediate_size;
  using model::ExpertTensor;
  for (int s = 0; s < shape_.slots_per_layer; ++s) {
    const int32_t b = map_.buffer_of(layer_idx, s);
    const int expert = experts[static_cast<size_t>(s)];
    if (shape_.fp8) {
      for (const ExpertTensor tensor : {ExpertTensor::kGateUp, ExpertTensor::kDown}) {
        const bool gu = tensor == ExpertTensor::kGateUp;
        const Fp8MatrixPtrs m = gu ? gate_up_fp8(b) : down_fp8(b);
        const int64_t rows = gu ? 2 * int64_t{i} : h, cols = gu ? h : i;
        FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_e4m3(const_cast<uint8_t*>(m.codes), rows * cols,
                                                              model::expert_weight_seed(seed, layer_idx, expert, tensor),
                                                              stream_));
        FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_f32(const_cast<float*>(m.scales), rows / 128 * (cols / 128),
                                                      model::expert_fp8_block_scale(tensor, h, i, expert), stream_));
      }
      continue;
    }
    FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(
        gate_up_buffer(b), gate_up_elems(), model::expert_weight_seed(seed, layer_idx, expert, ExpertTensor::kGateUp),
        model::expert_weight_scale(ExpertTensor::kGateUp, h, i), stream_));
    FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(
        down_buffer(b), down_elems(), model::expert_weight_seed(seed, layer_idx, expert, ExpertTensor::kDown),
        model::expert_weight_scale(ExpertTensor::kDown, h, i), stream_));
  }
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::pair<std::vector<std::byte>, std::vector<std::byte>> GpuSlotPool::download_blobs(int32_t buffer) const {
  std::pair<std::vector<std::byte>, std::vector<std::byte>> out{std::vector<std::byte>(static_cast<size_t>(gate_up_blob_bytes())),
                                                                 std::vector<std::byte>(static_cast<size_t>(down_blob_bytes()))};
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(out.first.data(), gate_up_blob(buffer), out.first.size(), cudaMemcpyDeviceToHost, stream_));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(out.second.data(), down_blob(buffer), out.second.size(), cudaMemcpyDeviceToHost, stream_));
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return out;
}

std::pair<std::vector<uint16_t>, std::vector<uint16_t>> GpuSlotPool::download_buffer(int32_t buffer) const {
  std::pair<std::vector<uint16_t>, std::vector<uint16_t>> out{std::vector<uint16_t>(static_cast<size_t>(gate_up_elems())),
                                                               std::vector<uint16_t>(static_cast<size_t>(down_elems()))};
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(out.first.data(), gate_up_buffer(buffer), out.first.size() * 2,
                                     cudaMemcpyDeviceToHost, stream_));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(out.second.data(), down_buffer(buffer), out.second.size() * 2,
                                     cudaMemcpyDeviceToHost, stream_));
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return out;
}

std::pair<std::vector<uint16_t>, std::vector<uint16_t>> GpuSlotPool::download_slot(int layer_idx, int local_slot) const {
  return download_buffer(map_.buffer_of(layer_idx, local_slot));
}

void GpuSlotPool::copy_buffer_async(int32_t dst, int32_t src, CUstream_st* stream) const {
  check_buffer(dst);
  check_buffer(src);
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(gate_up_blob(dst), gate_up_blob(src), static_cast<size_t>(gate_up_blob_bytes()),
                                     cudaMemcpyDeviceToDevice, stream));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(down_blob(dst), down_blob(src), static_cast<size_t>(down_blob_bytes()),
                                     cudaMemcpyDeviceToDevice, stream));
}

int GpuSlotPool::migrate_layer_locally(int layer_idx, std::span<const int32_t> old_row, std::span<const int32_t> new_row) {
  check_layer(layer_idx);
  const eplb::Topology topo{shape_.slots_per_layer, 1, 1};
  const std::vector<eplb::SlotTransfer> transfers = plan_layer_transfers(topo, layer_idx, old_row, new_row);
  if (transfers.empty()) return 0;
  const std::vector<int32_t> reserved = map_.reserve(layer_idx, static_cast<int>(transfers.size()));
  try {
    for (size_t j = 0; j < transfers.size(); ++j) {
      copy_buffer_async(reserved[j], map_.buffer_of(layer_idx, transfers[j].src_slot), stream_);
    }
    FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  } catch (...) {
    cudaStreamSynchronize(stream_);  // no copy still writes a buffer that goes back to the free list
    map_.release_reserved(layer_idx);
    throw;
  }
  for (size_t j = 0; j < transfers.size(); ++j) map_.remap(layer_idx, transfers[j].dst_slot, reserved[j]);
  map_.release_reserved(layer_idx);
  return static_cast<int>(transfers.size());
}

int GpuSlotPool::migrate_layer_over(comm::DeviceExchange& exchange, int layer_idx, std::span<const int32_t> old_row,
                                    std::span<const int32_t> new_row) {
  check_layer(layer_idx);
  const int w = exchange.size(), me = exchange.rank(), s = shape_.slots_per_layer;
  const eplb::Topology topo{s * w, w, 1};
  const std::vector<eplb::SlotTransfer> transfers = plan_layer_transfers(topo, layer_idx, old_row, new_row);
  if (transfers.empty()) return 0;  // the same on every rank
  // This rank's receives (reserved[j] for mine[j]), and the slot counts between each pair of ranks.
  std::vector<const eplb::SlotTransfer*> mine;
  std::vector<int64_t> send_counts(static_cast<size_t>(w), 0), recv_counts(static_cast<size_t>(w), 0);
  int64_t crossing = 0;  // over every rank: all skip the exchange together when no slot crosses
  for (const eplb::SlotTransfer& t : transfers) {
    const int src = t.src_slot / s, dst = t.dst_slot / s;
    if (dst == me) mine.push_back(&t);
    if (src == dst) continue;
    ++crossing;
    if (src == me) send_counts[static_cast<size_t>(dst)] += slot_bytes();
    if (dst == me) recv_counts[static_cast<size_t>(src)] += slot_bytes();
  }
  const std::vector<int32_t> reserved = map_.reserve(layer_idx, static_cast<int>(mine.size()));
  const auto reserved_for = [&](const eplb::SlotTransfer& t) {
    return reserved[static_cast<size_t>(std::find(mine.begin(), mine.end(), &t) - mine.begin())];
  };
  // Packs (or unpacks) the blobs of the transfers from src_rank to dst_rank, in transfer order, at `bytes`.
  const auto copy_pair = [&](int src_rank, int dst_rank, std::byte* bytes, bool pack) {
    for (const eplb::SlotTransfer& t : transfers) {
      if (t.src_slot / s != src_rank || t.dst_slot / s != dst_rank) continue;
      const int32_t buffer = pack ? map_.buffer_of(layer_idx, t.src_slot - me * s) : reserved_for(t);
      const std::pair<std::byte*, int64_t> blobs[] = {{gate_up_blob(buffer), gate_up_blob_bytes()},
                                                      {down_blob(buffer), down_blob_bytes()}};
      for (const auto& [blob, size] : blobs) {
        FULCRUM_CUDA_CHECK(cudaMemcpyAsync(pack ? bytes : blob, pack ? blob : bytes, static_cast<size_t>(size),
                                           cudaMemcpyDeviceToDevice, stream_));
        bytes += size;
      }
    }
  };
  try {
    for (const eplb::SlotTransfer* t : mine) {
      if (t->src_slot / s == me) copy_buffer_async(reserved_for(*t), map_.buffer_of(layer_idx, t->src_slot - me * s), stream_);
    }
    if (crossing > 0) {
      int64_t send_total = 0, recv_total = 0;
      for (int r = 0; r < w; ++r) {
        send_total += send_counts[static_cast<size_t>(r)];
        recv_total += recv_counts[static_cast<size_t>(r)];
      }
      DeviceBuffer send(static_cast<size_t>(std::max<int64_t>(send_total, 16)));
      DeviceBuffer recv(static_cast<size_t>(std::max<int64_t>(recv_total, 16)));
      std::byte* at = send.as<std::byte>();
      for (int r = 0; r < w; ++r) {
        if (r != me) copy_pair(me, r, at, /*pack=*/true);
        at += send_counts[static_cast<size_t>(r)];
      }
      FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the exchange reads send after its caller's writes
      exchange.all_to_all_v_device(send.as<std::byte>(), send_counts, recv.as<std::byte>(), recv_counts);
      at = recv.as<std::byte>();
      for (int r = 0; r < w; ++r) {
        if (r != me) copy_pair(r, me, at, /*pack=*/false);
        at += recv_counts[static_cast<size_t>(r)];
      }
    }
    FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the staging buffers go away at scope end
  } catch (...) {
    cudaStreamSynchronize(stream_);  // no copy still writes a buffer that goes back to the free list
    map_.release_reserved(layer_idx);
    throw;
  }
  for (const eplb::SlotTransfer* t : mine) map_.remap(layer_idx, t->dst_slot - me * s, reserved_for(*t));
  map_.release_reserved(layer_idx);
  return static_cast<int>(mine.size());
}

}  // namespace fulcrum::backend
