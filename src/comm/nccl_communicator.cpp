#include "comm/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <exception>
#include <numeric>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "eplb/error.hpp"

namespace fulcrum::comm {

struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  const PeerMesh* mesh = nullptr;
  bool aborted = false;
  // Device staging for the host-span calls, grown on demand.
  std::byte* d_send = nullptr;
  std::byte* d_recv = nullptr;
  size_t send_capacity = 0;
  size_t recv_capacity = 0;

  ~State() {
    if (comm != nullptr && !aborted) {
      // Every rank tears its communicators down in the same order (the engine's members), so NCCL's
      // teardown finds its peers; when a peer failed, or this rank is unwinding from an error (its peers may
      // be inside a collective), abort instead.
      const bool clean = std::uncaught_exceptions() == 0;
      if (clean && mesh->failure().empty() && ncclCommFinalize(comm) == ncclInProgress) {
        ncclResult_t state = ncclInProgress;
        while (state == ncclInProgress && mesh->failure().empty()) {
          ncclCommGetAsyncError(comm, &state);
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      }
      if (clean && mesh->failure().empty()) {
        ncclCommDestroy(comm);
      } else {
        ncclCommAbort(comm);
      }
    }
    if (d_send != nullptr) cudaFree(d_send);
    if (d_recv != nullptr) cudaFree(d_recv);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  [[noreturn]] void fail(const std::string& why) {
    if (comm != nullptr && !aborted) {
      aborted = true;
      ncclCommAbort(comm);  // releases this rank's NCCL kernels and proxies: nothing waits on the peers any more
    }
    throw Error("NCCL communicator aborted: " + why);
  }

  void check(ncclResult_t status, const char* expr) {
    if (status == ncclSuccess || status == ncclInProgress) return;
    const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
    fail(fmt::format("{} failed: {} ({})", expr, ncclGetErrorString(status), last != nullptr ? last : ""));
  }

  // The peers are alive and NCCL reports no asynchronous error; otherwise abort and throw.
  void check_health() {
    const std::string peer = mesh->failure();
    if (!peer.empty()) fail(peer);
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      const char* last = ncclGetLastError(comm);
      fail(fmt::format("asynchronous NCCL error {} ({})", ncclGetErrorString(async), last != nullptr ? last : ""));
    }
  }

  // Non-blocking communicators: a call may return before its work is queued; wait for that, watching peers.
  void wait_queued(ncclComm_t c) {
    while (true) {
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(c, &state);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) check(state, "ncclCommGetAsyncError");
      const std::string peer = mesh->failure();
      if (!peer.empty()) fail(peer);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // Waits for everything on the stream, polling so a dead peer or an NCCL error ends the wait.
  void wait_stream() {
    for (int spins = 0;; ++spins) {
      const cudaError_t status = cudaStreamQuery(stream);
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) FULCRUM_CUDA_CHECK(status);
      check_health();
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  void reserve(std::byte*& buffer, size_t& capacity, size_t bytes) {
    if (bytes <= capacity) return;
    if (buffer != nullptr) FULCRUM_CUDA_CHECK(cudaFree(buffer));
    buffer = nullptr;
    capacity = 0;
    FULCRUM_CUDA_CHECK(cudaMalloc(&buffer, bytes));
    capacity = bytes;
  }

  void upload(std::span<const std::byte> host) {
    reserve(d_send, send_capacity, std::max<size_t>(host.size(), 1));
    if (!host.empty()) FULCRUM_CUDA_CHECK(cudaMemcpyAsync(d_send, host.data(), host.size(), cudaMemcpyHostToDevice, stream));
  }

  // After the NCCL work completed (wait_stream): a pageable download blocks the host, so never before.
  void download(std::span<std::byte> host, const std::byte* device) {
    if (host.empty()) return;
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(host.data(), device, host.size(), cudaMemcpyDeviceToHost, stream));
    FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
};

#define FULCRUM_NCCL_CALL(state, expr) (state).check((expr), #expr)

namespace {

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; waits poll, so a dead peer can abort them
  return config;
}

std::unique_ptr<NcclCommunicator::State> new_state(const PeerMesh& mesh) {
  auto state = std::make_unique<NcclCommunicator::State>();
  state->mesh = &mesh;
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking));
  return state;
}

}  // namespace

NcclCommunicator::NcclCommunicator(std::unique_ptr<TcpCommunicator> host, std::unique_ptr<State> state)
    : host_(std::move(host)), state_(std::move(state)) {}

NcclCommunicator::~NcclCommunicator() = default;

std::unique_ptr<NcclCommunicator> NcclCommunicator::create_world(std::shared_ptr<PeerMesh> mesh) {
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);  // NVLink multicast stays off whatever the environment says
  auto host = std::make_unique<TcpCommunicator>(mesh);
  ncclUniqueId id{};
  if (host->rank() == 0) {
    const ncclResult_t status = ncclGetUniqueId(&id);
    FULCRUM_CHECK(status == ncclSuccess, "ncclGetUniqueId failed: {}", ncclGetErrorString(status));
  }
  host->broadcast(std::as_writable_bytes(std::span<ncclUniqueId>(&id, 1)), 0);
  auto state = new_state(*mesh);
  ncclConfig_t config = nonblocking_config();
  FULCRUM_NCCL_CALL(*state, ncclCommInitRankConfig(&state->comm, host->size(), id, host->rank(), &config));
  state->wait_queued(state->comm);
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(host), std::move(state)));
}

void NcclCommunicator::all_reduce_sum(std::span<float> data) {
  if (data.empty()) return;
  State& s = *state_;
  s.upload(std::as_bytes(data));
  FULCRUM_NCCL_CALL(s, ncclAllReduce(s.d_send, s.d_send, data.size(), ncclFloat, ncclSum, s.comm, s.stream));
  s.wait_queued(s.comm);
  s.wait_stream();
  s.download(std::as_writable_bytes(data), s.d_send);
}

void NcclCommunicator::all_gather(std::span<const std::byte> send, std::span<std::byte> recv) {
  FULCRUM_CHECK(recv.size() == send.size() * size(), "all_gather: recv has {} bytes, expected {} x {}", recv.size(),
                size(), send.size());
  if (send.empty()) return;
  State& s = *state_;
  s.upload(send);
  s.reserve(s.d_recv, s.recv_capacity, recv.size());
  FULCRUM_NCCL_CALL(s, ncclAllGather(s.d_send, s.d_recv, send.size(), ncclUint8, s.comm, s.stream));
  s.wait_queued(s.comm);
  s.wait_stream();
  s.download(recv, s.d_recv);
}

void NcclCommunicator::all_gather_v(std::span<const std::byte> send, std::span<std::byte> recv,
                                    std::span<const int64_t> recv_counts) {
  FULCRUM_CHECK(static_cast<int>(recv_counts.size()) == size() && recv_counts[rank()] == static_cast<int64_t>(send.size()),
                "all_gather_v: counts do not match this rank's {} bytes", send.size());
  const int64_t total = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
  FULCRUM_CHECK(total <= static_cast<int64_t>(recv.size()), "all_gather_v: recv buffer of {} bytes is too small",
                recv.size());
  // Every rank sends its whole block to every other rank, one NCCL group.
  State& s = *state_;
  s.upload(send);
  s.reserve(s.d_recv, s.recv_capacity, std::max<size_t>(static_cast<size_t>(total), 1));
  const std::byte* block = s.d_send;
  int64_t offset = 0;
  FULCRUM_NCCL_CALL(s, ncclGroupStart());
  for (int r = 0; r < size(); ++r) {
    if (r == rank()) {
      if (!send.empty()) FULCRUM_CUDA_CHECK(cudaMemcpyAsync(s.d_recv + offset, block, send.size(), cudaMemcpyDeviceToDevice, s.stream));
    } else {
      if (!send.empty()) FULCRUM_NCCL_CALL(s, ncclSend(block, send.size(), ncclUint8, r, s.comm, s.stream));
      if (recv_counts[r] > 0) FULCRUM_NCCL_CALL(s, ncclRecv(s.d_recv + offset, recv_counts[r], ncclUint8, r, s.comm, s.stream));
    }
    offset += recv_counts[r];
  }
  FULCRUM_NCCL_CALL(s, ncclGroupEnd());
  s.wait_queued(s.comm);
  s.wait_stream();
  s.download(recv.first(static_cast<size_t>(total)), s.d_recv);
}

void NcclCommunicator::reduce_scatter_sum(std::span<const float> send, std::span<float> recv) {
  FULCRUM_CHECK(send.size() == recv.size() * size(), "reduce_scatter: send has {} floats, expected {} x {}",
                send.size(), size(), recv.size());
  if (recv.empty()) return;
  State& s = *state_;
  s.upload(std::as_bytes(send));
  s.reserve(s.d_recv, s.recv_capacity, recv.size_bytes());
  FULCRUM_NCCL_CALL(s, ncclReduceScatter(s.d_send, s.d_recv, recv.size(), ncclFloat, ncclSum, s.comm, s.stream));
  s.wait_queued(s.comm);
  s.wait_stream();
  s.download(std::as_writable_bytes(recv), s.d_recv);
}

void NcclCommunicator::reduce_scatter_sum_device(const float* send, float* recv, int64_t count) {
  FULCRUM_CHECK(count >= 0, "reduce_scatter: negative count {}", count);
  if (count == 0) return;
  State& s = *state_;
  FULCRUM_NCCL_CALL(s, ncclReduceScatter(send, recv, static_cast<size_t>(count), ncclFloat, ncclSum, s.comm, s.stream));
  s.wait_queued(s.comm);
  s.wait_stream();
}

void NcclCommunicator::all_to_all_v_device(const std::byte* send, std::span<const int64_t> send_counts, std::byte* recv,
                                           std::span<const int64_t> recv_counts) {
  check_exchange_counts(rank(), size(), send_counts, recv_counts);
  State& s = *state_;
  int64_t send_offset = 0;
  int64_t recv_offset = 0;
  FULCRUM_NCCL_CALL(s, ncclGroupStart());
  for (int r = 0; r < size(); ++r) {
    if (r == rank()) {
      if (send_counts[r] > 0) {
        FULCRUM_CUDA_CHECK(cudaMemcpyAsync(recv + recv_offset, send + send_offset, send_counts[r], cudaMemcpyDeviceToDevice, s.stream));
      }
    } else {
      if (send_counts[r] > 0) FULCRUM_NCCL_CALL(s, ncclSend(send + send_offset, send_counts[r], ncclUint8, r, s.comm, s.stream));
      if (recv_counts[r] > 0) FULCRUM_NCCL_CALL(s, ncclRecv(recv + recv_offset, recv_counts[r], ncclUint8, r, s.comm, s.stream));
    }
    send_offset += send_counts[r];
    recv_offset += recv_counts[r];
  }
  FULCRUM_NCCL_CALL(s, ncclGroupEnd());
  s.wait_queued(s.comm);
  s.wait_stream();
}

void NcclCommunicator::exchange_device(std::span<const DeviceSend> sends, std::span<const DeviceRecv> recvs) {
  exchange_device_async(sends, recvs).wait();
}

NcclCommunicator::PendingExchange NcclCommunicator::exchange_device_async(std::span<const DeviceSend> sends,
                                                                          std::span<const DeviceRecv> recvs,
                                                                          CUevent_st* start_after) {
  const auto check_peer = [this](int peer, int64_t bytes) {
    FULCRUM_CHECK(peer >= 0 && peer < size() && peer != rank(), "exchange_device: peer {} is not another rank of {}",
                  peer, size());
    FULCRUM_CHECK(bytes >= 0, "exchange_device: negative byte count {}", bytes);
  };
  for (const DeviceSend& s : sends) check_peer(s.peer, s.bytes);
  for (const DeviceRecv& r : recvs) check_peer(r.peer, r.bytes);
  PendingExchange pending;
  if (sends.empty() && recvs.empty()) return pending;
  State& s = *state_;
  if (start_after != nullptr) FULCRUM_CUDA_CHECK(cudaStreamWaitEvent(s.stream, start_after, 0));
  FULCRUM_NCCL_CALL(s, ncclGroupStart());
  for (const DeviceSend& d : sends) {
    if (d.bytes > 0) FULCRUM_NCCL_CALL(s, ncclSend(d.data, static_cast<size_t>(d.bytes), ncclUint8, d.peer, s.comm, s.stream));
  }
  for (const DeviceRecv& d : recvs) {
    if (d.bytes > 0) FULCRUM_NCCL_CALL(s, ncclRecv(d.data, static_cast<size_t>(d.bytes), ncclUint8, d.peer, s.comm, s.stream));
  }
  FULCRUM_NCCL_CALL(s, ncclGroupEnd());
  s.wait_queued(s.comm);
  FULCRUM_CUDA_CHECK(cudaEventCreateWithFlags(&pending.done_, cudaEventDisableTiming));
  pending.comm_ = this;
  FULCRUM_CUDA_CHECK(cudaEventRecord(pending.done_, s.stream));
  return pending;
}

NcclCommunicator::PendingExchange::~PendingExchange() {
  if (done_ != nullptr) cudaEventDestroy(done_);  // safe while pending: released once the event completes
}

NcclCommunicator::PendingExchange::PendingExchange(PendingExchange&& other) noexcept
    : comm_(std::exchange(other.comm_, nullptr)), done_(std::exchange(other.done_, nullptr)) {}

NcclCommunicator::PendingExchange& NcclCommunicator::PendingExchange::operator=(PendingExchange&& other) noexcept {
  if (this != &other) {
    if (done_ != nullptr) cudaEventDestroy(done_);
    comm_ = std::exchange(other.comm_, nullptr);
    done_ = std::exchange(other.done_, nullptr);
  }
  return *this;
}

bool NcclCommunicator::PendingExchange::ready() {
  if (done_ == nullptr) return true;
  const cudaError_t status = cudaEventQuery(done_);
  if (status == cudaSuccess) return true;
  if (status != cudaErrorNotReady) FULCRUM_CUDA_CHECK(status);
  comm_->state_->check_health();
  return false;
}

void NcclCommunicator::PendingExchange::wait() {
  for (int spins = 0; !ready(); ++spins) {
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void NcclCommunicator::all_to_all_v(std::span<const std::byte> send, std::span<const int64_t> send_counts,
                                    std::span<std::byte> recv, std::span<const int64_t> recv_counts) {
  FULCRUM_CHECK(static_cast<int>(send_counts.size()) == size() && static_cast<int>(recv_counts.size()) == size(),
                "all_to_all_v: counts must have one entry per rank ({})", size());
  const int64_t send_total = std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0});
  const int64_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
  FULCRUM_CHECK(send_total <= static_cast<int64_t>(send.size()), "all_to_all_v: send buffer of {} bytes is smaller than its counts",
                send.size());
  FULCRUM_CHECK(recv_total <= static_cast<int64_t>(recv.size()), "all_to_all_v: recv buffer of {} bytes is too small",
                recv.size());
  State& s = *state_;
  s.upload(send.first(static_cast<size_t>(send_total)));
  s.reserve(s.d_recv, s.recv_capacity, std::max<size_t>(static_cast<size_t>(recv_total), 1));
  all_to_all_v_device(s.d_send, send_counts, s.d_recv, recv_counts);
  s.download(recv.first(static_cast<size_t>(recv_total)), s.d_recv);
}

void NcclCommunicator::broadcast(std::span<std::byte> data, int root) {
  FULCRUM_CHECK(root >= 0 && root < size(), "broadcast: root {} out of range", root);
  if (data.empty()) return;
  State& s = *state_;
  s.upload(data);
  FULCRUM_NCCL_CALL(s, ncclBroadcast(s.d_send, s.d_send, data.size(), ncclUint8, root, s.comm, s.stream));
  s.wait_queued(s.comm);
  s.wait_stream();
  s.download(data, s.d_send);
}

void NcclCommunicator::barrier() {
  float one = 1.0f;
  all_reduce_sum(std::span<float>(&one, 1));
}

void NcclCommunicator::send(std::span<const std::byte> data, int peer) { host_->send(data, peer); }

void NcclCommunicator::recv(std::span<std::byte> data, int peer) { host_->recv(data, peer); }

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) { return split_nccl(color, key); }

std::unique_ptr<NcclCommunicator> NcclCommunicator::split_nccl(int color, int key, int max_ctas) {
  FULCRUM_CHECK(max_ctas >= 0, "NCCL communicator split: max_ctas {} is negative", max_ctas);
  State& s = *state_;
  auto state = new_state(host_->mesh());
  ncclConfig_t config = nonblocking_config();
  if (max_ctas > 0) config.maxCTAs = max_ctas;
  FULCRUM_NCCL_CALL(s, ncclCommSplit(s.comm, color, key, &state->comm, &config));
  s.wait_queued(s.comm);
  if (state->comm == nullptr) s.fail("ncclCommSplit returned no communicator");
  state->wait_queued(state->comm);
  // The host twin orders its group by (key, parent rank) exactly as ncclCommSplit does.
  auto host = host_->split_tcp(color, key);
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(host), std::move(state)));
}

std::unique_ptr<NcclCommunicator> join_local_world(const LocalRank& me, std::chrono::milliseconds timeout) {
  const int num_devices = backend::CudaBackend::device_count();
  FULCRUM_CHECK(num_devices > 0, "rank {}: no CUDA device", me.rank);
  FULCRUM_CUDA_CHECK(cudaSetDevice(me.rank % num_devices));
  return NcclCommunicator::create_world(PeerMesh::connect(me.dist_init(timeout)));
}

}  // namespace fulcrum::comm
