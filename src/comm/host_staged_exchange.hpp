#pragma once
// DeviceExchange over any Communicator: the rows go device -> host, through the communicator's all_to_all_v, and
// host -> device, on a stream of the exchange's own that it waits for. For EP ranks that share one GPU (threads of
// one process over InProcessCommunicator, or processes over TcpCommunicator), where NCCL refuses two ranks of a
// communicator on one device (NVIDIA/nccl#418); across GPUs NcclCommunicator moves the rows device to device.
// No CUDA header here.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/device_exchange.hpp"

struct CUstream_st;

namespace fulcrum::comm {

class HostStagedExchange final : public DeviceExchange {
 public:
  // `comm` must outlive the exchange; `device`: the CUDA device whose memory the rows are in.
  HostStagedExchange(Communicator& comm, int device);
  ~HostStagedExchange() override;
  HostStagedExchange(const HostStagedExchange&) = delete;
  HostStagedExchange& operator=(const HostStagedExchange&) = delete;

  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  void all_gather(std::span<const std::byte> send, std::span<std::byte> recv) override { comm_.all_gather(send, recv); }
  void all_to_all_v_device(const std::byte* send, std::span<const int64_t> send_counts, std::byte* recv,
                           std::span<const int64_t> recv_counts) override;

 private:
  Communicator& comm_;
  int device_ = 0;
  CUstream_st* stream_ = nullptr;
  std::vector<std::byte> send_host_, recv_host_;
};

}  // namespace fulcrum::comm
