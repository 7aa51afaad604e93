#pragma once
// A Communicator over a PeerMesh (ranks as processes, on one host or several): the host path for
// --device cpu when ranks run as processes, and the buffered send/recv of the NCCL communicator.
// Collectives are direct exchanges (every rank sends its part to every rank that needs it): meant for the
// few ranks of a test or a small model, not for bandwidth.
// NOTES: reductions sum in rank order starting from 0.0f, exactly as the in-process communicator, so the
// two give bitwise the same results.
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/peer_mesh.hpp"

namespace fulcrum::comm {

class TcpCommunicator final : public Communicator {
 public:
  // The world: every rank of the mesh, in mesh rank order.
  explicit TcpCommunicator(std::shared_ptr<PeerMesh> mesh);
  // An elastic world's epoch (PeerMesh::begin_epoch): the mesh ranks `members` (ascending, this rank among
  // them), with group ids of its own so that no message of an earlier epoch's world is ever read by it.
  static std::unique_ptr<TcpCommunicator> over_members(std::shared_ptr<PeerMesh> mesh, std::vector<int> members,
                                                       uint64_t epoch);

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }

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

  // split() without the type erasure (the NCCL communicator keeps its host twin in step).
  std::unique_ptr<TcpCommunicator> split_tcp(int color, int key);
  // The group's world ranks, in group rank order.
  const std::vector<int>& members() const { return members_; }
  const PeerMesh& mesh() const { return *mesh_; }
  const std::shared_ptr<PeerMesh>& shared_mesh() const { return mesh_; }

 private:
  TcpCommunicator(std::shared_ptr<PeerMesh> mesh, std::vector<int> members, int rank, uint64_t group_id);
  // Collectives and point to point use separate channels, so a pending send never meets a collective.
  uint64_t collective_channel() const { return group_id_; }
  uint64_t p2p_channel() const { return group_id_ | 1; }
  void send_to(int peer, std::span<const std::byte> data);
  std::vector<std::byte> recv_from(int peer);
  // Every rank's `mine`, in rank order.
  std::vector<std::vector<std::byte>> exchange(std::span<const std::byte> mine);

  std::shared_ptr<PeerMesh> mesh_;
  std::vector<int> members_;  // world rank of each group rank
  int rank_;
  uint64_t group_id_;  // even and nonzero; every member derives the same one
  uint64_t num_splits_ = 0;
};

}  // namespace fulcrum::comm
