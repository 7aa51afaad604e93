#pragma once
// The device path of the MoE exchange's rows (engine::RowExchange): CUDA backend tensors go GPU to GPU
// through NCCL on their own device memory, never through the host. Ordering with the backend's compute
// stream: each collective first waits for the backend (the rows are written), and returns once NCCL is done
// (the next kernel may read what arrived). This header includes no CUDA or NCCL header.
#include "backend/cuda/cuda_backend.hpp"
#include "comm/nccl_communicator.hpp"
#include "engine/row_exchange.hpp"

namespace fulcrum::comm {

class NcclRowExchange final : public engine::RowExchange {
 public:
  // Both must outlive the exchange.
  NcclRowExchange(backend::CudaBackend& backend, NcclCommunicator& group) : backend_(backend), group_(group) {}
  std::string_view path() const override { return "device"; }

  void all_gather_v(const model::Tensor& send, const model::Tensor& recv, std::span<const int64_t> row_counts) override;
  void all_to_all_v(const model::Tensor& send, std::span<const int64_t> send_rows, const model::Tensor& recv,
                    std::span<const int64_t> recv_rows) override;
  void reduce_scatter_sum(const model::Tensor& send, const model::Tensor& recv) override;

 private:
  backend::CudaBackend& backend_;
  NcclCommunicator& group_;
};

}  // namespace fulcrum::comm
