#pragma once
// Communication between ranks behind one interface: in-process threads for tests and the CPU engine,
// NCCL for GPUs. Every call is collective over the group unless it says otherwise (send/recv).
// NOTES: reductions sum in rank order, so every rank of a group gets bitwise the same result.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace fulcrum::comm {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data[i] = sum over ranks of data[i].
  virtual void all_reduce_sum(std::span<float> data) = 0;
  // recv = concatenation of every rank's send, in rank order; recv.size() == size() * send.size().
  virtual void all_gather(std::span<const std::byte> send, std::span<std::byte> recv) = 0;
  // Variable sizes: rank r contributes recv_counts[r] bytes (its send.size()), placed in rank order.
  virtual void all_gather_v(std::span<const std::byte> send, std::span<std::byte> recv,
                            std::span<const int64_t> recv_counts) = 0;
  // send = size() blocks of recv.size() floats; recv = sum over ranks of block rank().
  virtual void reduce_scatter_sum(std::span<const float> send, std::span<float> recv) = 0;
  // send holds send_counts[r] bytes for each rank r in rank order; recv gets recv_counts[r] from each r.
  virtual void all_to_all_v(std::span<const std::byte> send, std::span<const int64_t> send_counts,
                            std::span<std::byte> recv, std::span<const int64_t> recv_counts) = 0;
  virtual void broadcast(std::span<std::byte> data, int root) = 0;
  virtual void barrier() = 0;

  // Point to point (not collective): matched in order per (sender, receiver) pair.
  virtual void send(std::span<const std::byte> data, int peer) = 0;
  virtual void recv(std::span<std::byte> data, int peer) = 0;

  // Collective: ranks with the same color form a new group, ordered by (key, rank).
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
};

// Typed views for the byte-level calls.
template <class T>
std::span<const std::byte> bytes_of(std::span<const T> s) {
  return std::as_bytes(s);
}
template <class T>
std::span<std::byte> writable_bytes_of(std::span<T> s) {
  return std::as_writable_bytes(s);
}

}  // namespace fulcrum::comm
