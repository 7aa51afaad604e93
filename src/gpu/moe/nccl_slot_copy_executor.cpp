#include "gpu/moe/nccl_slot_copy_executor.hpp"

#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.hpp"
#include "eplb/error.hpp"

namespace fulcrum::comm {

namespace {

std::byte* bytes_at(const model::Tensor& t) { return reinterpret_cast<std::byte*>(t.data()); }
int64_t byte_count(const model::Tensor& t) { return t.numel() * static_cast<int64_t>(sizeof(float)); }

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
  const SlotRunOps ops = merge_slot_runs(ep_comm_, sends_, recvs_, gate_up_bytes_, down_bytes_);
  ep_comm_.exchange_device(ops.sends, ops.recvs);
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
