#include "comm/peer_mesh.hpp"

#include <algorithm>
#include <exception>

#include <sys/socket.h>

#include <fmt/format.h>

#include "eplb/error.hpp"

namespace fulcrum::comm {
namespace {

// NOTES: the wire format is the hosts' native byte order (every rank runs the same x86-64 build).
constexpr uint32_t kMagic = 0x464c4d31;  // "FLM1"
constexpr uint64_t kGoodbyeChannel = 0;  // a frame on channel 0 says "this rank is done"
constexpr uint64_t kHeartbeatChannel = 1;  // "still here" (no group uses it: group ids are even and nonzero)
// Elastic: "abort epoch E" (8 bytes: E), and the recovery's messages. Groups use even ids and their odd
// twins (the world's point-to-point channel is 3), pseudo-random past the world's: these two are far from both.
constexpr uint64_t kAbortChannel = 0xffff'ffff'ffff'ff01;
constexpr uint64_t kControlChannel = 0xffff'ffff'ffff'ff03;
constexpr int kHeartbeatsPerTimeout = 5;

struct Hello {
  uint32_t magic = kMagic;
  int32_t world_size = 0;
  int32_t rank = 0;
  int32_t mesh_port = 0;
};

struct FrameHeader {
  uint64_t channel = 0;
  uint64_t num_bytes = 0;
};

template <class T>
std::span<const std::byte> pod_bytes(const T& value) {
  return std::as_bytes(std::span<const T>(&value, 1));
}
template <class T>
std::span<std::byte> pod_writable(T& value) {
  return std::as_writable_bytes(std::span<T>(&value, 1));
}

void write_string(const Socket& s, const std::string& text, const std::string& what) {
  const uint32_t n = static_cast<uint32_t>(text.size());
  write_all(s, pod_bytes(n), what);
  write_all(s, std::as_bytes(std::span<const char>(text)), what);
}

std::string read_string(const Socket& s, const std::string& what, Clock::time_point deadline) {
  uint32_t n = 0;
  FULCRUM_CHECK(read_all(s, pod_writable(n), what, deadline) && n < (1u << 20), "{}: connection closed", what);
  std::string text(n, '\0');
  FULCRUM_CHECK(read_all(s, std::as_writable_bytes(std::span<char>(text)), what, deadline) || n == 0,
                "{}: connection closed", what);
  return text;
}

struct Joined {
  Socket socket;
  Hello hello;
  std::string address;
};

// World rank 0: accepts every other rank, checks what they announce, and answers each with the address
// table (or, on any mismatch, the same one-line error, which it also throws).
std::vector<HostPort> serve_rendezvous(const DistInit& init, int my_mesh_port, Clock::time_point deadline) {
  const std::string what = "rendezvous on " + init.address.str();
  const Socket listener = listen_tcp(init.address.port, what);
  std::vector<Joined> joined;
  std::vector<bool> seen(init.world_size, false);
  seen[0] = true;
  std::string error;
  while (error.empty() && static_cast<int>(joined.size()) < init.world_size - 1) {
    Joined j;
    try {
      j.socket = accept_tcp(listener, deadline, what);
    } catch (const Error&) {
      std::vector<int> missing;
      for (int r = 0; r < init.world_size; ++r) {
        if (!seen[r]) missing.push_back(r);
      }
      error = fmt::format("{}: only {} of {} ranks joined within {} s (missing ranks {})", what, joined.size() + 1,
                          init.world_size, init.timeout.count() / 1000.0, fmt::join(missing, ", "));
      break;
    }
    j.address = peer_address(j.socket);
    try {
      const Clock::time_point hello_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(5));
      if (!read_all(j.socket, pod_writable(j.hello), what, hello_deadline) || j.hello.magic != kMagic) {
        continue;  // not a fulcrum rank (a port scanner, a stale client): ignore it
      }
    } catch (const Error&) {
      continue;  // silent or cut short within 5 s: not a fulcrum rank either
    }
    const Hello& h = j.hello;
    if (h.world_size != init.world_size) {
      error = fmt::format("{}: mismatched world sizes: rank {} at {} has {}, rank 0 has {}", what, h.rank, j.address,
                          h.world_size, init.world_size);
    } else if (h.rank <= 0 || h.rank >= init.world_size) {
      error = fmt::format("{}: rank {} at {} is outside [1, {})", what, h.rank, j.address, init.world_size);
    } else if (seen[h.rank]) {
      error = fmt::format("{}: rank {} joined twice (the second from {})", what, h.rank, j.address);
    } else {
      seen[h.rank] = true;
    }
    joined.push_back(std::move(j));
  }
  std::vector<HostPort> table(init.world_size);
  table[0] = {init.address.host, my_mesh_port};
  for (const Joined& j : joined) {
    if (j.hello.rank > 0 && j.hello.rank < init.world_size) table[j.hello.rank] = {j.address, j.hello.mesh_port};
  }
  for (const Joined& j : joined) {
    try {
      const uint32_t status = error.empty() ? 0 : 1;
      write_all(j.socket, pod_bytes(status), what);
      if (!error.empty()) {
        write_string(j.socket, error, what);
        continue;
      }
      for (const HostPort& hp : table) {
        write_string(j.socket, hp.host, what);
        write_all(j.socket, pod_bytes(static_cast<int32_t>(hp.port)), what);
      }
    } catch (const Error&) {
      // a rank that is gone will fail its own way; the others still get their answer
    }
  }
  FULCRUM_CHECK(error.empty(), "{}", error);
  return table;
}

std::vector<HostPort> join_rendezvous(const DistInit& init, int my_mesh_port, Clock::time_point deadline) {
  const std::string what = fmt::format("rank {} joining the rendezvous at {}", init.rank, init.address.str());
  const Socket s = connect_tcp(init.address, deadline, what);
  write_all(s, pod_bytes(Hello{kMagic, init.world_size, init.rank, my_mesh_port}), what);
  // Rank 0 answers by its own deadline (with the error when ranks are missing): wait for it a while longer.
  deadline += init.timeout;
  uint32_t status = 0;
  FULCRUM_CHECK(read_all(s, pod_writable(status), what, deadline), "{}: rank 0 closed the connection", what);
  if (status != 0) throw Error(read_string(s, what, deadline));
  std::vector<HostPort> table(init.world_size);
  for (HostPort& hp : table) {
    hp.host = read_string(s, what, deadline);
    int32_t port = 0;
    FULCRUM_CHECK(read_all(s, pod_writable(port), what, deadline), "{}: connection closed", what);
    hp.port = port;
  }
  table[0].host = init.address.host;  // rank 0 is where we found it
  return table;
}

}  // namespace

PeerMesh::PeerMesh(int rank, int world_size) : rank_(rank) {
  for (int r = 0; r < world_size; ++r) peers_.push_back(std::make_unique<Peer>());
}

std::shared_ptr<PeerMesh> PeerMesh::connect(const DistInit& init) {
  FULCRUM_CHECK(init.world_size >= 1, "world size must be at least 1, got {}", init.world_size);
  FULCRUM_CHECK(init.rank >= 0 && init.rank < init.world_size, "rank {} outside [0, {})", init.rank, init.world_size);
  std::shared_ptr<PeerMesh> mesh(new PeerMesh(init.rank, init.world_size));
  if (init.world_size == 1) return mesh;
  const auto deadline = Clock::now() + init.timeout;
  const Socket listener = listen_tcp(0, "rank " + std::to_string(init.rank) + " mesh");
  const int mesh_port = local_port(listener);
  const std::vector<HostPort> table = init.rank == 0 ? serve_rendezvous(init, mesh_port, deadline)
                                                      : join_rendezvous(init, mesh_port, deadline);
  // Each rank connects to the lower ranks and accepts the higher ones (a listener queues early arrivals).
  for (int r = 0; r < init.rank; ++r) {
    const std::string what = fmt::format("rank {} connecting to rank {} at {}", init.rank, r, table[r].str());
    Peer& peer = *mesh->peers_[r];
    peer.socket = connect_tcp(table[r], deadline, what);
    peer.address = table[r].str();
    write_all(peer.socket, pod_bytes(Hello{kMagic, init.world_size, init.rank, 0}), what);
  }
  for (int n = init.rank + 1; n < init.world_size; ++n) {
    const std::string what = fmt::format("rank {} waiting for the higher ranks' connections", init.rank);
    Socket s = accept_tcp(listener, deadline, what);
    Hello h;
    FULCRUM_CHECK(read_all(s, pod_writable(h), what, deadline) && h.magic == kMagic && h.rank > init.rank &&
                      h.rank < init.world_size && !mesh->peers_[h.rank]->socket.valid(),
                  "{}: unexpected connection from {}", what, peer_address(s));
    mesh->peers_[h.rank]->address = fmt::format("{}:{}", peer_address(s), table[h.rank].port);
    mesh->peers_[h.rank]->socket = std::move(s);
  }
  mesh->liveness_timeout_ = init.liveness_timeout;
  mesh->start_readers();
  if (init.liveness_timeout.count() > 0) mesh->heartbeat_ = std::thread([m = mesh.get()] { m->heartbeat_loop(); });
  return mesh;
}

void PeerMesh::start_readers() {
  const Clock::time_point now = Clock::now();
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    peers_[r]->last_heard = now;
    peers_[r]->reader = std::thread([this, r] { read_loop(r); });
  }
}

void PeerMesh::heartbeat_loop() {
  const auto tick = liveness_timeout_ / kHeartbeatsPerTimeout;
  std::unique_lock lock(mutex_);
  while (!closing_) {
    lock.unlock();
    for (int r = 0; r < size(); ++r) {
      if (r == rank_) continue;
      Peer& peer = *peers_[r];
      // try_lock: a send in progress says as much as a heartbeat, and a blocked one must not block this loop.
      std::unique_lock write(peer.write_mutex, std::try_to_lock);
      if (!write.owns_lock()) continue;
      try {
        write_all(peer.socket, pod_bytes(FrameHeader{kHeartbeatChannel, 0}), "heartbeat");
      } catch (const Error&) {
        // the reader sees why
      }
    }
    lock.lock();
    cv_.wait_for(lock, tick, [&] { return closing_; });
  }
}

void PeerMesh::check_liveness(int src, Clock::time_point now) {
  Peer& peer = *peers_[src];
  if (liveness_timeout_.count() == 0 || peer.state != PeerState::kConnected || now - peer.last_heard < liveness_timeout_) {
    return;
  }
  peer.state = PeerState::kFailed;
  if (failure_.empty()) {
    failure_ = fmt::format("rank {} ({}) sent nothing, not even a heartbeat, for {:.1f} s (it hung, was stopped or lost "
                           "its connection): {}",
                           src, peer.address, liveness_timeout_.count() / 1000.0, kPeerFailedPhrase);
  }
  on_peer_failed();
  peer.socket.shutdown_both();  // it is out of this world for good, whatever it does later
}

bool PeerMesh::peer_failed(int peer) const {
  FULCRUM_CHECK(peer >= 0 && peer < size() && peer != rank_, "peer {} outside the world of {} (or self)", peer, size());
  std::lock_guard lock(mutex_);
  return peers_[peer]->state == PeerState::kFailed;
}

void PeerMesh::read_loop(int src) {
  Peer& peer = *peers_[src];
  const std::string what = fmt::format("rank {} reading from rank {}", rank_, src);
  PeerState end = PeerState::kFailed;
  try {
    while (true) {
      FrameHeader header;
      if (!read_all(peer.socket, pod_writable(header), what)) break;  // end of stream without goodbye
      if (header.channel == kGoodbyeChannel) {
        end = PeerState::kLeft;
        break;
      }
      if (header.channel == kHeartbeatChannel) {
        std::lock_guard lock(mutex_);
        peer.last_heard = Clock::now();
        continue;
      }
      if (header.channel == kAbortChannel) {
        uint64_t epoch = 0;
        FULCRUM_CHECK(header.num_bytes == sizeof(epoch) && read_all(peer.socket, pod_writable(epoch), what),
                      "{}: malformed abort frame", what);
        std::lock_guard lock(mutex_);
        peer.last_heard = Clock::now();
        if (elastic_ && epoch == epoch_) aborted_ = true;
        cv_.notify_all();
        continue;
      }
      FULCRUM_CHECK(header.num_bytes <= (uint64_t{1} << 40), "{}: frame of {} bytes", what, header.num_bytes);
      std::vector<std::byte> message(header.num_bytes);
      if (!read_all(peer.socket, message, what) && !message.empty()) break;
      std::lock_guard lock(mutex_);
      peer.last_heard = Clock::now();
      mailboxes_[{header.channel, src}].push_back(std::move(message));
      cv_.notify_all();
    }
  } catch (const std::exception&) {
    // a reset, a cut connection or a garbage frame: the peer failed
  }
  std::lock_guard lock(mutex_);
  if (peer.state == PeerState::kConnected) peer.state = end;  // (a silent peer was marked failed already)
  end = peer.state;
  peer.reader_done = true;
  if (end == PeerState::kFailed && failure_.empty()) {
    failure_ = fmt::format("rank {} ({}) {}: it failed or was killed", src, peer.address, kPeerFailedPhrase);
  }
  if (end == PeerState::kFailed) on_peer_failed();
  cv_.notify_all();
}

void PeerMesh::send(uint64_t channel, int dst, std::span<const std::byte> data) {
  FULCRUM_CHECK(dst >= 0 && dst < size() && dst != rank_, "send: peer {} outside the world of {} (or self)", dst, size());
  Peer& peer = *peers_[dst];
  {
    std::lock_guard lock(mutex_);
    FULCRUM_CHECK(peer.state != PeerState::kFailed, "{}", failure_.empty() ? "a peer failed" : failure_);
  }
  const std::string what = fmt::format("rank {} sending to rank {} ({})", rank_, dst, peer.address);
  try {
    std::lock_guard lock(peer.write_mutex);
    write_all(peer.socket, pod_bytes(FrameHeader{channel, data.size()}), what);
    if (!data.empty()) write_all(peer.socket, data, what);
  } catch (const Error&) {
    // A broken pipe says less than the reader, which sees why the peer went away: ask it (briefly).
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, std::chrono::seconds(1), [&] { return peer.reader_done; });
    if (peer.state == PeerState::kFailed && !failure_.empty()) throw Error(failure_);
    throw;
  }
}

std::vector<std::byte> PeerMesh::recv(uint64_t channel, int src) { return recv_on(channel, src, true); }

std::vector<std::byte> PeerMesh::recv_on(uint64_t channel, int src, bool abortable) {
  FULCRUM_CHECK(src >= 0 && src < size() && src != rank_, "recv: peer {} outside the world of {} (or self)", src, size());
  std::unique_lock lock(mutex_);
  auto& box = mailboxes_[{channel, src}];
  const Peer& peer = *peers_[src];
  const auto is_aborted = [&] { return abortable && aborted_; };
  const auto ready = [&] { return !box.empty() || peer.state != PeerState::kConnected || is_aborted(); };
  if (liveness_timeout_.count() == 0) {
    cv_.wait(lock, ready);
  } else {
    while (!ready()) {
      cv_.wait_for(lock, liveness_timeout_ / kHeartbeatsPerTimeout);
      if (box.empty()) check_liveness(src, Clock::now());
    }
  }
  if (is_aborted()) {
    throw Error(fmt::format("the world of epoch {} was aborted: {}", epoch_,
                            failure_.empty() ? "another rank saw a failure" : failure_));
  }
  if (box.empty()) {
    FULCRUM_CHECK(peer.state != PeerState::kFailed, "{}", failure_.empty() ? "a peer failed" : failure_);
    throw Error(fmt::format("rank {} ({}) finished while rank {} still expected a message from it", src, peer.address,
                            rank_));
  }
  std::vector<std::byte> message = std::move(box.front());
  box.pop_front();
  return message;
}

void PeerMesh::on_peer_failed() {
  if (elastic_) aborted_ = true;
  cv_.notify_all();
}

void PeerMesh::set_elastic(bool on) {
  std::lock_guard lock(mutex_);
  elastic_ = on;
}

uint64_t PeerMesh::epoch() const {
  std::lock_guard lock(mutex_);
  return epoch_;
}

bool PeerMesh::aborted() const {
  std::lock_guard lock(mutex_);
  return aborted_;
}

void PeerMesh::abort_epoch() {
  uint64_t epoch = 0;
  {
    std::lock_guard lock(mutex_);
    aborted_ = true;
    epoch = epoch_;
    cv_.notify_all();
  }
  for (int r = 0; r < size(); ++r) {
    if (r == rank_ || peer_failed(r)) continue;
    try {
      send(kAbortChannel, r, pod_bytes(epoch));
    } catch (const Error&) {
      // it is gone: the recovery finds out
    }
  }
}

void PeerMesh::begin_epoch(uint64_t epoch, const std::vector<int>& members) {
  std::lock_guard lock(mutex_);
  FULCRUM_CHECK(epoch > epoch_, "epoch {} after epoch {}", epoch, epoch_);
  epoch_ = epoch;
  failure_.clear();  // the next epoch's errors name its own failure
  aborted_ = std::any_of(members.begin(), members.end(),
                         [&](int r) { return r != rank_ && peers_.at(static_cast<size_t>(r))->state != PeerState::kConnected; });
}

void PeerMesh::send_control(int dst, std::span<const std::byte> data) { send(kControlChannel, dst, data); }

std::vector<std::byte> PeerMesh::recv_control(int src) { return recv_on(kControlChannel, src, false); }

std::string PeerMesh::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

const Socket& PeerMesh::peer_socket(int peer) const {
  FULCRUM_CHECK(peer >= 0 && peer < size() && peer != rank_, "peer {} outside the world of {} (or self)", peer, size());
  return peers_[peer]->socket;
}

PeerMesh::~PeerMesh() {
  if (heartbeat_.joinable()) {
    {
      std::lock_guard lock(mutex_);
      closing_ = true;
    }
    cv_.notify_all();
    heartbeat_.join();
  }
  // Unwinding after an error: no goodbye, so the peers take this rank for failed instead of waiting for it.
  if (std::uncaught_exceptions() > 0) {
    for (auto& peer : peers_) peer->socket.shutdown_both();
    for (auto& peer : peers_) {
      if (peer->reader.joinable()) peer->reader.join();
    }
    return;
  }
  // Goodbye, then half-close: the peers read everything sent so far, then the goodbye, then end of stream.
  for (int r = 0; r < size(); ++r) {
    if (r == rank_ || !peers_[r]->socket.valid()) continue;
    try {
      std::lock_guard lock(peers_[r]->write_mutex);
      write_all(peers_[r]->socket, pod_bytes(FrameHeader{kGoodbyeChannel, 0}), "goodbye");
    } catch (const Error&) {
    }
    ::shutdown(peers_[r]->socket.fd(), SHUT_WR);
  }
  // Wait (bounded) for the peers' own goodbyes so no unread byte turns our close into a reset.
  {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] {
      return std::all_of(peers_.begin(), peers_.end(), [&](const auto& p) { return !p->reader.joinable() || p->reader_done; });
    });
  }
  for (auto& peer : peers_) {
    peer->socket.shutdown_both();
    if (peer->reader.joinable()) peer->reader.join();
  }
}

}  // namespace fulcrum::comm
