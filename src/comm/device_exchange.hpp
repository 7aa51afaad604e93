#pragma once
// What expert parallelism on GPUs asks of a transport: a small all-gather of host arrays (per-slot row counts)
// and an all-to-all of rows that live in device memory. Two implementations: NcclCommunicator (device to device,
// one process per GPU) and HostStagedExchange (rows staged through host memory over any Communicator, so EP
// ranks can be threads sharing one GPU: in-process tests and a second process beside the first on one device,
// where NCCL refuses two ranks of a communicator). Collective over the group. Transport only.
#include <cstddef>
#include <cstdint>
#include <span>

#include "eplb/error.hpp"

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

// The counts every all_to_all_v_device checks: one entry per rank, and what a rank sends itself is what it expects.
inline void check_exchange_counts(int rank, int size, std::span<const int64_t> send_counts,
                                  std::span<const int64_t> recv_counts) {
  FULCRUM_CHECK(static_cast<int>(send_counts.size()) == size && static_cast<int>(recv_counts.size()) == size,
                "all_to_all_v: counts must have one entry per rank ({})", size);
  FULCRUM_CHECK(send_counts[rank] == recv_counts[rank], "all_to_all_v: rank {} sends itself {} bytes but expects {}", rank,
                send_counts[rank], recv_counts[rank]);
}

}  // namespace fulcrum::comm
