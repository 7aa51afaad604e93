#include "gpu/moe/gpu_slot_pool.hpp"

#include "backend/cuda/cuda_check.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "eplb/error.hpp"
#include "model/random_weights.hpp"

namespace fulcrum::backend {

namespace {

eplb_runtime::SlotBufferMap checked_map(const SlotPoolShape& shape) {
  FULCRUM_CHECK(shape.hidden_size > 0 && shape.moe_intermediate_size > 0,
                "slot pool: hidden {} / intermediate {} must be positive", shape.hidden_size, shape.moe_intermediate_size);
  return eplb_runtime::SlotBufferMap(shape.num_layers, shape.slots_per_layer, shape.spare);
}

}  // namespace

GpuSlotPool::GpuSlotPool(const SlotPoolShape& shape, int device_idx)
    : shape_(shape), device_idx_(device_idx), map_(checked_map(shape)) {
  shape_.spare = map_.num_buffers() - shape.num_layers * shape.slots_per_layer;
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx));
  const auto buffers = static_cast<size_t>(map_.num_buffers());
  gate_up_ = DeviceBuffer(buffers * static_cast<size_t>(gate_up_elems()) * sizeof(uint16_t));
  down_ = DeviceBuffer(buffers * static_cast<size_t>(down_elems()) * sizeof(uint16_t));
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

uint16_t* GpuSlotPool::gate_up_buffer(int32_t buffer) const {
  FULCRUM_CHECK(buffer >= 0 && buffer < map_.num_buffers(), "slot pool: buffer {} outside [0, {})", buffer,
                map_.num_buffers());
  return gate_up_.as<uint16_t>() + static_cast<size_t>(buffer) * static_cast<size_t>(gate_up_elems());
}

uint16_t* GpuSlotPool::down_buffer(int32_t buffer) const {
  FULCRUM_CHECK(buffer >= 0 && buffer < map_.num_buffers(), "slot pool: buffer {} outside [0, {})", buffer,
                map_.num_buffers());
  return down_.as<uint16_t>() + static_cast<size_t>(buffer) * static_cast<size_t>(down_elems());
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

void GpuSlotPool::upload_layer(int layer_idx, std::span<const uint16_t> gate_up, std::span<const uint16_t> down) {
  check_layer(layer_idx);
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
    FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(
        gate_up_buffer(b), gate_up_elems(), model::expert_weight_seed(seed, layer_idx, expert, ExpertTensor::kGateUp),
        model::expert_weight_scale(ExpertTensor::kGateUp, h, i), stream_));
    FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(
        down_buffer(b), down_elems(), model::expert_weight_seed(seed, layer_idx, expert, ExpertTensor::kDown),
        model::expert_weight_scale(ExpertTensor::kDown, h, i), stream_));
  }
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
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

}  // namespace fulcrum::backend
