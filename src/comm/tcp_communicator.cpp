#include "comm/tcp_communicator.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "eplb/dispatch.hpp"
#include "eplb/error.hpp"

namespace fulcrum::comm {
namespace {

constexpr uint64_t kWorldGroupId = 2;

uint64_t mix(uint64_t x) { return eplb::SplitMix64(x).next(); }  // one splitmix64 step from x

}  // namespace

TcpCommunicator::TcpCommunicator(std::shared_ptr<PeerMesh> mesh)
    : mesh_(std::move(mesh)), members_(mesh_->size()), rank_(mesh_->rank()), group_id_(kWorldGroupId) {
  std::iota(members_.begin(), members_.end(), 0);
}

TcpCommunicator::TcpCommunicator(std::shared_ptr<PeerMesh> mesh, std::vector<int> members, int rank, uint64_t group_id)
    : mesh_(std::move(mesh)), members_(std::move(members)), rank_(rank), group_id_(group_id) {}

std::unique_ptr<TcpCommunicator> TcpCommunicator::over_members(std::shared_ptr<PeerMesh> mesh, std::vector<int> members,
                                                               uint64_t epoch) {
  FULCRUM_CHECK(std::is_sorted(members.begin(), members.end()), "over_members: members not in ascending order");
  const auto me = std::find(members.begin(), members.end(), mesh->rank());
  FULCRUM_CHECK(me != members.end(), "over_members: rank {} is not a member", mesh->rank());
  const int rank = static_cast<int>(me - members.begin());
  uint64_t id = mix(mix(kWorldGroupId) ^ mix(epoch)) & ~uint64_t{1};
  if (id == 0) id = kWorldGroupId + 4;
  return std::unique_ptr<TcpCommunicator>(new TcpCommunicator(std::move(mesh), std::move(members), rank, id));
}

void TcpCommunicator::send_to(int peer, std::span<const std::byte> data) {
  mesh_->send(collective_channel(), members_[peer], data);
}

std::vector<std::byte> TcpCommunicator::recv_from(int peer) { return mesh_->recv(collective_channel(), members_[peer]); }

std::vector<std::vector<std::byte>> TcpCommunicator::exchange(std::span<const std::byte> mine) {
  for (int r = 0; r < size(); ++r) {
    if (r != rank_) send_to(r, mine);
  }
  std::vector<std::vector<std::byte>> all(size());
  for (int r = 0; r < size(); ++r) all[r] = r == rank_ ? std::vector<std::byte>(mine.begin(), mine.end()) : recv_from(r);
  return all;
}

void TcpCommunicator::all_reduce_sum(std::span<float> data) {
  const auto all = exchange(std::as_bytes(data));
  std::vector<float> sum(data.size(), 0.0f);
  for (int r = 0; r < size(); ++r) {
    FULCRUM_CHECK(all[r].size() == data.size_bytes(), "all_reduce_sum: rank {} has {} bytes, this rank {}", r,
                  all[r].size(), data.size_bytes());
    const auto* src = reinterpret_cast<const float*>(all[r].data());
    for (size_t i = 0; i < data.size(); ++i) sum[i] += src[i];
  }
  std::copy(sum.begin(), sum.end(), data.begin());
}

void TcpCommunicator::all_gather(std::span<const std::byte> send, std::span<std::byte> recv) {
  FULCRUM_CHECK(recv.size() == send.size() * size(), "all_gather: recv has {} bytes, expected {} x {}", recv.size(),
                size(), send.size());
  std::vector<int64_t> counts(size(), static_cast<int64_t>(send.size()));
  all_gather_v(send, recv, counts);
}

void TcpCommunicator::all_gather_v(std::span<const std::byte> send, std::span<std::byte> recv,
                                   std::span<const int64_t> recv_counts) {
  FULCRUM_CHECK(static_cast<int>(recv_counts.size()) == size() && recv_counts[rank_] == static_cast<int64_t>(send.size()),
                "all_gather_v: counts do not match this rank's {} bytes", send.size());
  FULCRUM_CHECK(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0}) <= static_cast<int64_t>(recv.size()),
                "all_gather_v: recv buffer of {} bytes is too small", recv.size());
  const auto all = exchange(send);
  size_t offset = 0;
  for (int r = 0; r < size(); ++r) {
    FULCRUM_CHECK(static_cast<int64_t>(all[r].size()) == recv_counts[r],
                  "all_gather_v: rank {} contributes {} bytes, this rank expects {}", r, all[r].size(), recv_counts[r]);
    std::copy(all[r].begin(), all[r].end(), recv.begin() + static_cast<std::ptrdiff_t>(offset));
    offset += all[r].size();
  }
}

void TcpCommunicator::reduce_scatter_sum(std::span<const float> send, std::span<float> recv) {
  FULCRUM_CHECK(send.size() == recv.size() * size(), "reduce_scatter: send has {} floats, expected {} x {}",
                send.size(), size(), recv.size());
  for (int r = 0; r < size(); ++r) {
    if (r != rank_) send_to(r, std::as_bytes(send.subspan(static_cast<size_t>(r) * recv.size(), recv.size())));
  }
  std::vector<float> sum(recv.size(), 0.0f);
  for (int r = 0; r < size(); ++r) {
    std::vector<std::byte> theirs;
    const float* src = send.data() + static_cast<size_t>(rank_) * recv.size();
    if (r != rank_) {
      theirs = recv_from(r);
      FULCRUM_CHECK(theirs.size() == recv.size_bytes(), "reduce_scatter: rank {} sends {} bytes, this rank expects {}",
                    r, theirs.size(), recv.size_bytes());
      src = reinterpret_cast<const float*>(theirs.data());
    }
    for (size_t i = 0; i < recv.size(); ++i) sum[i] += src[i];
  }
  std::copy(sum.begin(), sum.end(), recv.begin());
}

void TcpCommunicator::all_to_all_v(std::span<const std::byte> send, std::span<const int64_t> send_counts,
                                   std::span<std::byte> recv, std::span<const int64_t> recv_counts) {
  FULCRUM_CHECK(static_cast<int>(send_counts.size()) == size() && static_cast<int>(recv_counts.size()) == size(),
                "all_to_all_v: counts must have one entry per rank ({})", size());
  FULCRUM_CHECK(std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0}) <= static_cast<int64_t>(send.size()),
                "all_to_all_v: send buffer of {} bytes is smaller than its counts", send.size());
  FULCRUM_CHECK(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0}) <= static_cast<int64_t>(recv.size()),
                "all_to_all_v: recv buffer of {} bytes is too small", recv.size());
  std::vector<size_t> send_offset(size() + 1, 0);
  for (int r = 0; r < size(); ++r) send_offset[r + 1] = send_offset[r] + static_cast<size_t>(send_counts[r]);
  for (int r = 0; r < size(); ++r) {
    if (r != rank_) send_to(r, send.subspan(send_offset[r], static_cast<size_t>(send_counts[r])));
  }
  std::string mismatch;  // reported after every message is consumed, so the channel stays in step
  size_t offset = 0;
  for (int r = 0; r < size(); ++r) {
    std::vector<std::byte> theirs;
    std::span<const std::byte> block = send.subspan(send_offset[r], static_cast<size_t>(send_counts[r]));
    if (r != rank_) {
      theirs = recv_from(r);
      block = theirs;
    }
    if (static_cast<int64_t>(block.size()) != recv_counts[r]) {
      mismatch = fmt::format("all_to_all_v: rank {} sends {} bytes to rank {}, which expects {}", r, block.size(), rank_,
                             recv_counts[r]);
    } else {
      std::copy(block.begin(), block.end(), recv.begin() + static_cast<std::ptrdiff_t>(offset));
    }
    offset += static_cast<size_t>(recv_counts[r]);
  }
  if (!mismatch.empty()) throw Error(mismatch);
}

void TcpCommunicator::broadcast(std::span<std::byte> data, int root) {
  FULCRUM_CHECK(root >= 0 && root < size(), "broadcast: root {} out of range", root);
  if (rank_ == root) {
    for (int r = 0; r < size(); ++r) {
      if (r != rank_) send_to(r, data);
    }
    return;
  }
  const std::vector<std::byte> message = recv_from(root);
  FULCRUM_CHECK(message.size() == data.size(), "broadcast: root {} sends {} bytes, this rank expects {}", root,
                message.size(), data.size());
  std::copy(message.begin(), message.end(), data.begin());
}

void TcpCommunicator::barrier() { exchange({}); }

void TcpCommunicator::send(std::span<const std::byte> data, int peer) {
  FULCRUM_CHECK(peer >= 0 && peer < size() && peer != rank_, "send: peer {} out of range", peer);
  mesh_->send(p2p_channel(), members_[peer], data);
}

void TcpCommunicator::recv(std::span<std::byte> data, int peer) {
  FULCRUM_CHECK(peer >= 0 && peer < size() && peer != rank_, "recv: peer {} out of range", peer);
  const std::vector<std::byte> message = mesh_->recv(p2p_channel(), members_[peer]);
  FULCRUM_CHECK(message.size() == data.size(), "recv from rank {}: got {} bytes, expected {}", peer, message.size(),
                data.size());
  std::copy(message.begin(), message.end(), data.begin());
}

std::unique_ptr<Communicator> TcpCommunicator::split(int color, int key) { return split_tcp(color, key); }

std::unique_ptr<TcpCommunicator> TcpCommunicator::split_tcp(int color, int key) {
  const int32_t mine[2] = {color, key};
  const auto all = exchange(std::as_bytes(std::span<const int32_t>(mine)));
  std::vector<std::pair<int32_t, int>> same;  // (key, group rank) of the ranks with my color
  for (int r = 0; r < size(); ++r) {
    int32_t theirs[2];
    FULCRUM_CHECK(all[r].size() == sizeof(theirs), "split: rank {} sent {} bytes", r, all[r].size());
    std::memcpy(theirs, all[r].data(), sizeof(theirs));
    if (theirs[0] == color) same.emplace_back(theirs[1], r);
  }
  std::stable_sort(same.begin(), same.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<int> members;
  int new_rank = 0;
  for (size_t i = 0; i < same.size(); ++i) {
    if (same[i].second == rank_) new_rank = static_cast<int>(i);
    members.push_back(members_[same[i].second]);
  }
  // Every member of the parent counts its splits alike, so (parent, split number, color) names the group.
  uint64_t id = mix(mix(group_id_ ^ mix(++num_splits_)) ^ static_cast<uint32_t>(color)) & ~uint64_t{1};
  if (id == 0) id = kWorldGroupId + 2;
  return std::unique_ptr<TcpCommunicator>(new TcpCommunicator(mesh_, std::move(members), new_rank, id));
}

}  // namespace fulcrum::comm
