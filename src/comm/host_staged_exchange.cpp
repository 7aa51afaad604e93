// Rows of an expert-parallel exchange staged through host memory (see host_staged_exchange.hpp).
#include "comm/host_staged_exchange.hpp"

#include <cuda_runtime.h>

#include <numeric>

#include "backend/cuda/cuda_check.hpp"
#include "eplb/error.hpp"

namespace fulcrum::comm {

HostStagedExchange::HostStagedExchange(Communicator& comm, int device) : comm_(comm), device_(device) {
  FULCRUM_CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t stream = nullptr;
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
}

HostStagedExchange::~HostStagedExchange() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void HostStagedExchange::all_to_all_v_device(const std::byte* send, std::span<const int64_t> send_counts, std::byte* recv,
                                             std::span<const int64_t> recv_counts) {
  check_exchange_counts(rank(), size(), send_counts, recv_counts);
  const int64_t send_total = std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0});
  const int64_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
  FULCRUM_CHECK(send_total >= 0 && recv_total >= 0, "all_to_all_v: negative byte counts");
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_));
  send_host_.resize(static_cast<size_t>(send_total));
  recv_host_.resize(static_cast<size_t>(recv_total));
  if (send_total > 0) {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(send_host_.data(), send, static_cast<size_t>(send_total), cudaMemcpyDeviceToHost, stream_));
    FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  comm_.all_to_all_v(send_host_, send_counts, recv_host_, recv_counts);
  if (recv_total > 0) {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(recv, recv_host_.data(), static_cast<size_t>(recv_total), cudaMemcpyHostToDevice, stream_));
    // From pageable memory the copy may return before its DMA lands: the wait makes recv visible to every stream.
    FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
}

}  // namespace fulcrum::comm
