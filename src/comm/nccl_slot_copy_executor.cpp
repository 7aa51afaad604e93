#include "comm/nccl_slot_copy_executor.hpp"

#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.hpp"
#include "eplb/error.hpp"

namespace fulcrum::comm {

namespace {

std::byte* bytes_at(const model::Tensor& t) { return reinterpret_cast<std::byte*>(t.data()); }
int64_t byte_count(const model::Tensor& t) { return t.numel() * static_cast<int64_t>(sizeof(float)); }

// 1 where a run of consecutive indices starts (index[i] != index[i-1] + 1).
template <typename Item>
std::vector<uint8_t> run_starts(const std::vector<const Item*>& items) {
  std::vector<uint8_t> starts(items.size());
  for (size_t i = 0; i < items.size(); ++i) starts[i] = i == 0 || items[i]->index != items[i - 1]->index + 1;
  return starts;
}

}  // namespace

NcclSlotCopyExecutor::NcclSlotCopyExecutor(backend::CudaBackend& backend, NcclCommunicator& ep_comm)
    : backend_(backend), ep_comm_(ep_comm) {
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

NcclSlotCopyExecutor::~NcclSlotCopyExecutor() {
  cudaStreamSynchronize(stream_);
  cudaStreamDestroy(stream_);
}

void NcclSlotCopyExecutor::begin_layer(const model::ExpertSlotView& view, int num_staging_slots) {
  FULCRUM_CHECK(sends_.empty() && recvs_.empty(), "slot migration: layer {} begins with unissued transfers",
                view.layer_idx);
  staging_.prepare(backend_, view, num_staging_slots);
  backend_.synchronize();  // staging zeroed, and no queued kernel still reads the slots this layer rewrites
}

void NcclSlotCopyExecutor::copy_async(const model::Tensor& dst, const model::Tensor& src) {
  FULCRUM_CHECK(dst.numel() == src.numel(), "slot migration: copy of {} values into {}", src.numel(), dst.numel());
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), static_cast<size_t>(byte_count(src)),
                                     cudaMemcpyDeviceToDevice, stream_));
}

void NcclSlotCopyExecutor::copy_local(const model::ExpertSlotView& view, int src_local_slot, int staging_idx) {
  staging_.check_idx(staging_idx);
  copy_async(staging_.gate_up().index(staging_idx), view.gate_up.index(src_local_slot));
  copy_async(staging_.down().index(staging_idx), view.down.index(src_local_slot));
}

void NcclSlotCopyExecutor::send(const model::ExpertSlotView& view, int src_local_slot, int dst_rank) {
  FULCRUM_CHECK(src_local_slot >= 0 && src_local_slot < view.num_slots, "slot migration: local slot {} outside [0, {})",
                src_local_slot, view.num_slots);
  FULCRUM_CHECK(dst_rank >= 0 && dst_rank < ep_comm_.size() && dst_rank != ep_comm_.rank(),
                "slot migration: send to rank {}, not another rank of {}", dst_rank, ep_comm_.size());
  const model::Tensor gate_up = view.gate_up.index(src_local_slot);
  const model::Tensor down = view.down.index(src_local_slot);
  gate_up_bytes_ = byte_count(gate_up);
  down_bytes_ = byte_count(down);
  sends_.push_back({dst_rank, src_local_slot, bytes_at(gate_up), bytes_at(down)});
}

void NcclSlotCopyExecutor::recv(const model::ExpertSlotView& /*view*/, int staging_idx, int src_rank) {
  staging_.check_idx(staging_idx);
  FULCRUM_CHECK(src_rank >= 0 && src_rank < ep_comm_.size() && src_rank != ep_comm_.rank(),
                "slot migration: recv from rank {}, not another rank of {}", src_rank, ep_comm_.size());
  const model::Tensor gate_up = staging_.gate_up().index(staging_idx);
  const model::Tensor down = staging_.down().index(staging_idx);
  gate_up_bytes_ = byte_count(gate_up);
  down_bytes_ = byte_count(down);
  recvs_.push_back({src_rank, staging_idx, bytes_at(gate_up), bytes_at(down)});
}

void NcclSlotCopyExecutor::issue() {
  const int size = ep_comm_.size();
  std::vector<std::vector<const Pending*>> out(size), in(size);
  for (const Pending& p : sends_) out[p.peer].push_back(&p);
  for (const Pending& p : recvs_) in[p.peer].push_back(&p);
  // Run starts, each rank's own first (as sender, then as receiver: buffered host sends), then the peer's.
  std::vector<std::vector<uint8_t>> out_starts(size), in_starts(size);
  for (int peer = 0; peer < size; ++peer) {
    out_starts[peer] = run_starts(out[peer]);
    in_starts[peer] = run_starts(in[peer]);
    if (!out[peer].empty()) ep_comm_.send(std::as_bytes(std::span<const uint8_t>(out_starts[peer])), peer);
    if (!in[peer].empty()) ep_comm_.send(std::as_bytes(std::span<const uint8_t>(in_starts[peer])), peer);
  }
  std::vector<NcclCommunicator::DeviceSend> sends;
  std::vector<NcclCommunicator::DeviceRecv> recvs;
  const auto add_segments = [this](const std::vector<const Pending*>& items, std::vector<uint8_t>& starts,
                                   const std::vector<uint8_t>& peer_starts, int peer, auto& ops) {
    for (size_t i = 0; i < items.size(); ++i) starts[i] |= peer_starts[i];
    for (size_t i = 0; i < items.size();) {
      size_t j = i + 1;
      while (j < items.size() && starts[j] == 0) ++j;
      const auto k = static_cast<int64_t>(j - i);
      ops.push_back({items[i]->gate_up, k * gate_up_bytes_, peer});
      ops.push_back({items[i]->down, k * down_bytes_, peer});
      i = j;
    }
  };
  for (int peer = 0; peer < size; ++peer) {
    std::vector<uint8_t> peer_starts;
    if (!in[peer].empty()) {  // the peer's runs as sender
      peer_starts.resize(in[peer].size());
      ep_comm_.recv(std::as_writable_bytes(std::span<uint8_t>(peer_starts)), peer);
      add_segments(in[peer], in_starts[peer], peer_starts, peer, recvs);
    }
    if (!out[peer].empty()) {  // the peer's runs as receiver
      peer_starts.resize(out[peer].size());
      ep_comm_.recv(std::as_writable_bytes(std::span<uint8_t>(peer_starts)), peer);
      add_segments(out[peer], out_starts[peer], peer_starts, peer, sends);
    }
  }
  ep_comm_.exchange_device(sends, recvs);
}

void NcclSlotCopyExecutor::wait() {
  try {
    issue();  // the local copies on stream_ run meanwhile
  } catch (...) {
    sends_.clear();  // after a failure nothing stale is issued again
    recvs_.clear();
    throw;
  }
  sends_.clear();
  recvs_.clear();
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void NcclSlotCopyExecutor::commit_slot(const model::ExpertSlotView& view, int staging_idx, int dst_local_slot) {
  staging_.check_idx(staging_idx);
  FULCRUM_CHECK(dst_local_slot >= 0 && dst_local_slot < view.num_slots, "slot migration: local slot {} outside [0, {})",
                dst_local_slot, view.num_slots);
  copy_async(view.gate_up.index(dst_local_slot), staging_.gate_up().index(staging_idx));
  copy_async(view.down.index(dst_local_slot), staging_.down().index(staging_idx));
}

void NcclSlotCopyExecutor::end_layer() {
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the next forward pass (backend stream) reads the commits
  staging_.clear();
}

}  // namespace fulcrum::comm
