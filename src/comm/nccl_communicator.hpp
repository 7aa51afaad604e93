#pragma once
// The Communicator of GPU rank processes: collectives through NCCL on the current CUDA device, over host
// spans (uploaded to device staging buffers on the communicator's own stream, downloaded after), plus a
// device-pointer path for callers whose data already lives on the GPU. Send/recv are buffered (a send never
// waits for its receiver), so they travel over the host mesh (TcpCommunicator) rather than ncclSend, whose
// unmatched sends would deadlock the send-everything-then-receive pattern of slot migration.
// Failures (an NCCL status, a CUDA error, an asynchronous NCCL error, a peer process that died) abort the
// NCCL communicator, so no rank waits forever, and throw fulcrum::Error with one line.
// NOTES: NVLink multicast (NVLS) is forced off: NCCL_NVLS_ENABLE=0 before the first communicator.
// NOTES: all_reduce_sum gives every rank bitwise the same result (NCCL reduces each element once and
// distributes it); its summation order is NCCL's, bitwise the rank-order sum for 2 ranks.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "comm/communicator.hpp"
#include "comm/device_exchange.hpp"
#include "comm/local_ranks.hpp"
#include "comm/peer_mesh.hpp"
#include "comm/tcp_communicator.hpp"

struct CUevent_st;  // cudaEvent_t

namespace fulcrum::comm {

class NcclCommunicator final : public Communicator, public DeviceExchange {
 public:
  // Collective over the mesh's world: rank 0 makes the ncclUniqueId and sends its bytes over the mesh; every
  // rank uses its current CUDA device (cudaSetDevice before).
  static std::unique_ptr<NcclCommunicator> create_world(std::shared_ptr<PeerMesh> mesh);
  ~NcclCommunicator() override;

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }

  void all_reduce_sum(std::span<float> data) override;
  void all_gather(std::span<const std::byte> send, std::span<std::byte> recv) override;
  void all_gather_v(std::span<const std::byte> send, std::span<std::byte> recv,
                    std::span<const int64_t> recv_counts) override;
  void reduce_scatter_sum(std::span<const float> send, std::span<float> recv) override;
  void all_to_all_v(std::span<const std::byte> send, std::span<const int64_t> send_counts, std::span<std::byte> recv,
                    std::span<const int64_t> recv_counts) override;
  void broadcast(std::span<std::byte> data, int root) override;
  void barrier() override;
  void send(std::span<const std::byte> data, int peer) override;
  void recv(std::span<std::byte> data, int peer) override;
  std::unique_ptr<Communicator> split(int color, int key) override;

  // Device pointers (current device): send holds send_counts[r] bytes per rank r in rank order, recv gets
  // recv_counts[r] bytes from each r; one NCCL group of ncclSend/ncclRecv, returns when complete.
  void all_to_all_v_device(const std::byte* send, std::span<const int64_t> send_counts, std::byte* recv,
                           std::span<const int64_t> recv_counts) override;

  // Device pointers (current device): send = size() blocks of `count` floats; recv [count] = sum over ranks of
  // block rank() (ncclReduceScatter, as reduce_scatter_sum); returns when complete.
  void reduce_scatter_sum_device(const float* send, float* recv, int64_t count);

  // Point-to-point between device buffers (current device): every send and recv of the call in one NCCL
  // group on the communicator's stream, matched in order per peer pair; returns when all are complete.
  // Unlike send/recv, both sides must call it (a group with the matching sends/recvs).
  struct DeviceSend {
    const std::byte* data = nullptr;
    int64_t bytes = 0;
    int peer = 0;
  };
  struct DeviceRecv {
    std::byte* data = nullptr;
    int64_t bytes = 0;
    int peer = 0;
  };
  void exchange_device(std::span<const DeviceSend> sends, std::span<const DeviceRecv> recvs);

  // A group enqueued on the communicator's stream and not yet waited for (exchange_device_async).
  class PendingExchange {
   public:
    PendingExchange() = default;  // nothing pending: ready at once
    ~PendingExchange();
    PendingExchange(PendingExchange&& other) noexcept;
    PendingExchange& operator=(PendingExchange&& other) noexcept;
    // The group is complete (an event query, no host wait). Throws, after aborting the communicator, when a
    // peer process failed or NCCL reports an asynchronous error.
    bool ready();
    // Waits for the group, polling as exchange_device does (a dead peer or an NCCL error ends the wait).
    void wait();

   private:
    friend class NcclCommunicator;
    NcclCommunicator* comm_ = nullptr;
    CUevent_st* done_ = nullptr;  // recorded on the communicator's stream after the group
  };
  // exchange_device that returns once the group is enqueued. `start_after` (optional): the group starts on
  // the device only after this event (cudaStreamWaitEvent), e.g. once readers of the receive buffers finished.
  // The buffers must stay valid until the exchange is ready.
  PendingExchange exchange_device_async(std::span<const DeviceSend> sends, std::span<const DeviceRecv> recvs,
                                        CUevent_st* start_after = nullptr);

  // split() with the NCCL type. Collective over this communicator.
  // max_ctas > 0 caps the thread blocks (SMs) the new communicator's kernels may use (ncclConfig_t::maxCTAs);
  // 0 leaves NCCL's choice.
  std::unique_ptr<NcclCommunicator> split_nccl(int color, int key, int max_ctas = 0);
  // A second communicator over the same ranks in the same order (its own NCCL communicator, stream and host
  // channel), so traffic on it never orders against this one's collectives: e.g. slot migration beside the
  // forward pass's dispatch. Collective over this communicator.
  std::unique_ptr<NcclCommunicator> duplicate(int max_ctas = 0) { return split_nccl(0, rank(), max_ctas); }

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  struct State;  // NCCL and CUDA handles (nccl_communicator.cpp)

 private:
  NcclCommunicator(std::unique_ptr<TcpCommunicator> host, std::unique_ptr<State> state);

  std::unique_ptr<TcpCommunicator> host_;  // the same group over the mesh: ids, send/recv, peer failures
  std::unique_ptr<State> state_;
};

// A rank process that run_local_rank_processes started (comm/local_ranks.hpp): makes GPU rank % device count
// its current device and joins the world (waiting up to `timeout` for the other ranks).
std::unique_ptr<NcclCommunicator> join_local_world(const LocalRank& me,
                                                   std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace fulcrum::comm
