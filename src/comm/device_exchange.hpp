#pragma once
// What expert parallelism on GPUs asks of a transport: a small all-gather of host arrays (per-slot row counts)
// and an all-to-all of rows that live in device memory. Two implementations: NcclCommunicator (device to device,
// one process per GPU) and HostStagedExchange (rows staged through host memory over any Communicator, so EP
// ranks can be threads sharing one GPU: in-process tests and a second process beside the first on one device,
// where NCCL refuses two ranks of a communicator). Collective over the group. Transport only.
#include <cstddef>
#include <cstdint>
#include <span>

namespace fulcrum::comm {

class DeviceExchange {
 public:
  virtual ~DeviceExchange() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Host memory: recv = every rank's send in rank order; recv.size() == size() * send.size().
  virtual void all_gather(std::span<const std::byte> send, std::span<std::byte> recv) = 0;
  // Device pointers (the caller's current device): send holds send_counts[r] bytes per rank r in rank order,
  // recv gets recv_counts[r] bytes from each r. The caller's writes to send are complete (its stream waited);
  // returns when recv is written and visible to later work on any stream of the device.
  virtual void all_to_all_v_device(const std::byte* send, std::span<const int64_t> send_counts, std::byte* recv,
                                   std::span<const int64_t> recv_counts) = 0;
};

}  // namespace fulcrum::comm
