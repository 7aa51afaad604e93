#include "comm/peer_mesh.hpp"

#include <algorithm>
#include <exception>
#include <optional>
#include <utility>

#include <poll.h>
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
// Rendezvous answers (a u32): the address table follows, an error line follows, or (rejoining) the world
// runs already and the table of its live ranks follows.
constexpr uint32_t kStatusOk = 0, kStatusError = 1, kStatusWorldRunning = 2;
// How long a kept listener waits for a connection's hello (a silent one is not a fulcrum rank).
constexpr std::chrono::seconds kHelloTimeout{5};

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

void write_table(const Socket& s, const std::vector<HostPort>& table, const std::string& what) {
  for (const HostPort& hp : table) {
    write_string(s, hp.host, what);
    write_all(s, pod_bytes(static_cast<int32_t>(hp.port)), what);
  }
}

struct Joined {
  Socket socket;
  Hello hello;
  std::string address;
};

// World rank 0: accepts every other rank, checks what they announce, and answers each with the address
// table (or, on any mismatch, the same one-line error, which it also throws).
std::vector<HostPort> serve_rendezvous(const DistInit& init, const Socket& listener, int my_mesh_port,
                                       Clock::time_point deadline) {
  const std::string what = "rendezvous on " + init.address.str();
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
      const Clock::time_point hello_deadline = std::min(deadline, Clock::now() + kHelloTimeout);
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
      const uint32_t status = error.empty() ? kStatusOk : kStatusError;
      write_all(j.socket, pod_bytes(status), what);
      if (!error.empty()) {
        write_string(j.socket, error, what);
        continue;
      }
      write_table(j.socket, table, what);
    } catch (const Error&) {
      // a rank that is gone will fail its own way; the others still get their answer
    }
  }
  FULCRUM_CHECK(error.empty(), "{}", error);
  return table;
}

// What rank 0 answered: the address table, and whether the world was running already (then a port of -1
// marks a rank that is not live).
struct RendezvousAnswer {
  std::vector<HostPort> table;
  bool world_running = false;
};

RendezvousAnswer join_rendezvous(const DistInit& init, int my_mesh_port, Clock::time_point deadline) {
  const std::string what = fmt::format("rank {} joining the rendezvous at {}", init.rank, init.address.str());
  const Socket s = connect_tcp(init.address, deadline, what);
  write_all(s, pod_bytes(Hello{kMagic, init.world_size, init.rank, my_mesh_port}), what);
  // Rank 0 answers by its own deadline (with the error when ranks are missing): wait for it a while longer.
  deadline += init.timeout;
  uint32_t status = 0;
  FULCRUM_CHECK(read_all(s, pod_writable(status), what, deadline), "{}: rank 0 closed the connection", what);
  if (status == kStatusError) throw Error(read_string(s, what, deadline));
  FULCRUM_CHECK(status == kStatusOk || status == kStatusWorldRunning, "{}: unknown answer {}", what, status);
  RendezvousAnswer answer{std::vector<HostPort>(init.world_size), status == kStatusWorldRunning};
  for (HostPort& hp : answer.table) {
    hp.host = read_string(s, what, deadline);
    int32_t port = 0;
    FULCRUM_CHECK(read_all(s, pod_writable(port), what, deadline), "{}: connection closed", what);
    hp.port = port;
  }
  answer.table[0].host = init.address.host;  // rank 0 is where we found it
  return answer;
}

// A newcomer's hello on a live rank's kept mesh listener: that rank's answer (kStatusOk, or an error line).
Socket connect_as_newcomer(const DistInit& init, int my_mesh_port, int to, const HostPort& address,
                           Clock::time_point deadline) {
  const std::string what = fmt::format("rank {} rejoining: connecting to rank {} at {}", init.rank, to, address.str());
  Socket s = connect_tcp(address, deadline, what);
  write_all(s, pod_bytes(Hello{kMagic, init.world_size, init.rank, my_mesh_port}), what);
  uint32_t status = 0;
  FULCRUM_CHECK(read_all(s, pod_writable(status), what, deadline), "{}: rank {} closed the connection", what, to);
  if (status != kStatusOk) throw Error(read_string(s, what, deadline));
  return s;
}

}  // namespace

PeerMesh::PeerMesh(int rank, int world_size) : rank_(rank), epoch_members_(static_cast<size_t>(world_size), true) {
  for (int r = 0; r < world_size; ++r) peers_.push_back(std::make_unique<Peer>());
}

std::shared_ptr<PeerMesh> PeerMesh::connect(const DistInit& init) {
  FULCRUM_CHECK(init.world_size >= 1, "world size must be at least 1, got {}", init.world_size);
  FULCRUM_CHECK(init.rank >= 0 && init.rank < init.world_size, "rank {} outside [0, {})", init.rank, init.world_size);
  std::shared_ptr<PeerMesh> mesh(new PeerMesh(init.rank, init.world_size));
  if (init.world_size == 1) return mesh;
  const auto deadline = Clock::now() + init.timeout;
  Socket listener = listen_tcp(0, "rank " + std::to_string(init.rank) + " mesh");
  const int mesh_port = local_port(listener);
  RendezvousAnswer answer;
  if (init.rank == 0) {
    Socket rendezvous = listen_tcp(init.address.port, "rendezvous on " + init.address.str());
    answer.table = serve_rendezvous(init, rendezvous, mesh_port, deadline);
    if (init.elastic) mesh->rendezvous_listener_ = std::move(rendezvous);
  } else {
    answer = join_rendezvous(init, mesh_port, deadline);
  }
  const std::vector<HostPort>& table = answer.table;
  if (answer.world_running) {
    // A newcomer: every live rank but 0 readmits it first, rank 0 last (which then counts it as ready).
    FULCRUM_CHECK(init.elastic, "rank {}: the world at {} is running already (only an elastic rank can rejoin it)",
                  init.rank, init.address.str());
    std::vector<int> order;
    for (int r = 1; r < init.world_size; ++r) order.push_back(r);
    order.push_back(0);
    for (const int r : order) {
      Peer& peer = *mesh->peers_[r];
      if (r == init.rank || table[r].port < 0) {
        peer.state = PeerState::kFailed;  // not live: out of every world until it rejoins too
        continue;
      }
      peer.socket = connect_as_newcomer(init, mesh_port, r, table[r], deadline);
      peer.address = table[r].str();
    }
    mesh->joined_late_ = true;
  } else {
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
  }
  mesh->liveness_timeout_ = init.liveness_timeout;
  if (init.elastic) {
    mesh->elastic_ = true;
    mesh->addresses_ = table;
    mesh->addresses_[init.rank].port = mesh_port;
    mesh->mesh_listener_ = std::move(listener);
  }
  mesh->start_readers();
  if (init.liveness_timeout.count() > 0) mesh->heartbeat_ = std::thread([m = mesh.get()] { m->heartbeat_loop(); });
  if (init.elastic) mesh->acceptor_ = std::thread([m = mesh.get()] { m->accept_loop(); });
  return mesh;
}

void PeerMesh::accept_loop() {
  const auto tick = std::chrono::milliseconds(100);  // how soon the destructor's closing_ is seen
  for (;;) {
    {
      std::lock_guard lock(mutex_);
      if (closing_) return;
    }
    std::vector<pollfd> fds{{mesh_listener_.fd(), POLLIN, 0}};
    if (rendezvous_listener_.valid()) fds.push_back({rendezvous_listener_.fd(), POLLIN, 0});
    if (::poll(fds.data(), fds.size(), static_cast<int>(tick.count())) <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if ((fds[i].revents & POLLIN) == 0) continue;
      try {
        const Socket& listener = i == 0 ? mesh_listener_ : rendezvous_listener_;
        Socket s = accept_tcp(listener, Clock::now() + tick, "a rejoining rank's connection");
        i == 0 ? answer_late_mesh_hello(std::move(s)) : answer_late_rendezvous(std::move(s));
      } catch (const std::exception&) {
        // a stray or broken connection: it is not a fulcrum rank; the listener goes on
      }
    }
  }
}

namespace {

// A hello on a kept listener (a stray connection: nullopt).
std::optional<Hello> read_late_hello(const Socket& s, const std::string& what) {
  Hello h;
  if (!read_all(s, pod_writable(h), what, Clock::now() + kHelloTimeout) || h.magic != kMagic) return std::nullopt;
  return h;
}

void refuse(const Socket& s, const std::string& error, const std::string& what) {
  write_all(s, pod_bytes(kStatusError), what);
  write_string(s, error, what);
}

}  // namespace

void PeerMesh::answer_late_rendezvous(Socket s) {
  const std::string what = fmt::format("rendezvous on rank 0 (world running, epoch {})", epoch());
  const std::optional<Hello> h = read_late_hello(s, what);
  if (!h) return;
  const std::string from = peer_address(s);
  std::vector<HostPort> table = addresses_;
  std::string error;
  {
    std::lock_guard lock(mutex_);
    if (h->world_size != size()) {
      error = fmt::format("{}: mismatched world sizes: rank {} at {} has {}, rank 0 has {}", what, h->rank, from,
                          h->world_size, size());
    } else if (h->rank <= 0 || h->rank >= size()) {
      error = fmt::format("{}: rank {} at {} is outside [1, {})", what, h->rank, from, size());
    } else if (peers_[h->rank]->state == PeerState::kConnected) {
      error = fmt::format("{}: rank {} (from {}) is still in the world: rank 0 has not seen it fail", what, h->rank,
                          from);
    }
    for (int r = 1; r < size(); ++r) {
      if (peers_[r]->state != PeerState::kConnected) table[r].port = -1;
    }
  }
  if (!error.empty()) return refuse(s, error, what);
  write_all(s, pod_bytes(kStatusWorldRunning), what);
  write_table(s, table, what);
}

void PeerMesh::answer_late_mesh_hello(Socket s) {
  const std::string what = fmt::format("rank {}: a rejoining rank's hello", rank_);
  const std::optional<Hello> h = read_late_hello(s, what);
  if (!h) return;
  const std::string from = peer_address(s);
  if (h->world_size != size() || h->rank <= 0 || h->rank >= size() || h->rank == rank_) {
    return refuse(s, fmt::format("{}: rank {} of a world of {} from {} does not fit this world of {}", what, h->rank,
                                 h->world_size, from, size()), what);
  }
  {
    std::lock_guard lock(mutex_);
    if (peers_[h->rank]->state == PeerState::kConnected) {
      return refuse(s, fmt::format("{}: rank {} (from {}) is still connected to rank {}", what, h->rank, from, rank_),
                    what);
    }
  }
  write_all(s, pod_bytes(kStatusOk), what);  // before the socket is shared: heartbeats may follow at once
  readmit(h->rank, std::move(s), fmt::format("{}:{}", from, h->mesh_port));
  std::lock_guard lock(mutex_);
  addresses_[h->rank] = {from, h->mesh_port};
  if (rank_ == 0) rejoined_.push_back(h->rank);
}

void PeerMesh::readmit(int src, Socket socket, const std::string& address) {
  Peer& peer = *peers_[src];
  peer.socket.shutdown_both();  // the old connection's reader (if any) ends
  if (peer.reader.joinable()) peer.reader.join();
  std::lock_guard write(peer.write_mutex);
  std::lock_guard lock(mutex_);
  peer.socket = std::move(socket);
  peer.address = address;
  peer.state = PeerState::kConnected;
  peer.reader_done = false;
  peer.last_heard = Clock::now();
  for (auto& [key, box] : mailboxes_) {
    if (key.second == src) box.clear();  // the old process's leftovers (cleared, not erased: a waiter holds its box)
  }
  peer.reader = std::thread([this, src] { read_loop(src); });
}

std::vector<int> PeerMesh::take_rejoined() {
  std::lock_guard lock(mutex_);
  return std::exchange(rejoined_, {});
}

void PeerMesh::start_readers() {
  const Clock::time_point now = Clock::now();
  for (int r = 0; r < size(); ++r) {
    if (r == rank_ || !peers_[r]->socket.valid()) continue;
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
  mark_failed(src, fmt::format("rank {} ({}) sent nothing, not even a heartbeat, for {:.1f} s (it hung, was stopped or "
                                "lost its connection): {}",
                                src, peer.address, liveness_timeout_.count() / 1000.0, kPeerFailedPhrase));
}

void PeerMesh::mark_failed(int src, const std::string& why) {
  Peer& peer = *peers_[src];
  peer.state = PeerState::kFailed;
  if (failure_.empty()) failure_ = why;
  on_peer_failed(src);
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
  if (end == PeerState::kFailed) on_peer_failed(src);
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

std::vector<std::byte> PeerMesh::recv_on(uint64_t channel, int src, bool abortable,
                                         std::optional<Clock::time_point> deadline) {
  FULCRUM_CHECK(src >= 0 && src < size() && src != rank_, "recv: peer {} outside the world of {} (or self)", src, size());
  std::unique_lock lock(mutex_);
  auto& box = mailboxes_[{channel, src}];
  const Peer& peer = *peers_[src];
  const auto is_aborted = [&] { return abortable && aborted_; };
  const auto ready = [&] { return !box.empty() || peer.state != PeerState::kConnected || is_aborted(); };
  // An elastic data wait of a step must see progress within the liveness timeout.
  const bool progress_bound = abortable && elastic_ && liveness_timeout_.count() > 0 && bounded_scopes_ > 0;
  const Clock::time_point started = Clock::now();
  bool stalled = false;
  if (liveness_timeout_.count() == 0 && !deadline) {
    cv_.wait(lock, ready);
  } else {
    const auto tick = liveness_timeout_.count() > 0 ? liveness_timeout_ / kHeartbeatsPerTimeout
                                                    : std::chrono::milliseconds(50);
    while (!ready()) {
      cv_.wait_for(lock, tick);
      if (!box.empty()) break;
      const Clock::time_point now = Clock::now();
      check_liveness(src, now);
      if (deadline && now >= *deadline && peer.state == PeerState::kConnected) {
        mark_failed(src, fmt::format("rank {} ({}) is alive but sent no answer in time (it stopped making progress): {}",
                                     src, peer.address, kPeerFailedPhrase));
      }
      if (progress_bound && now - started >= liveness_timeout_ && !ready()) {
        stalled = true;
        if (failure_.empty()) {
          failure_ = fmt::format("rank {} waited {:.1f} s for rank {} ({}), which is alive but made no progress",
                                 rank_, liveness_timeout_.count() / 1000.0, src, peer.address);
        }
        break;
      }
    }
  }
  if (stalled) {
    const std::string why = failure_;
    lock.unlock();
    abort_epoch();  // every rank's waits end; rank 0's roll call finds which rank stopped
    throw Error(fmt::format("the world of epoch {} was aborted: {}", epoch(), why));
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

void PeerMesh::on_peer_failed(int src) {
  if (elastic_ && epoch_members_[static_cast<size_t>(src)]) aborted_ = true;
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
  std::fill(epoch_members_.begin(), epoch_members_.end(), false);
  for (const int m : members) epoch_members_.at(static_cast<size_t>(m)) = true;
  failure_.clear();  // the next epoch's errors name its own failure
  aborted_ = std::any_of(members.begin(), members.end(),
                         [&](int r) { return r != rank_ && peers_.at(static_cast<size_t>(r))->state != PeerState::kConnected; });
}

void PeerMesh::send_control(int dst, std::span<const std::byte> data) { send(kControlChannel, dst, data); }

std::vector<std::byte> PeerMesh::recv_control(int src) { return recv_on(kControlChannel, src, false); }

PeerMesh::BoundedWaits::BoundedWaits(PeerMesh& mesh) : mesh_(mesh) {
  std::lock_guard lock(mesh_.mutex_);
  ++mesh_.bounded_scopes_;
}

PeerMesh::BoundedWaits::~BoundedWaits() {
  std::lock_guard lock(mesh_.mutex_);
  --mesh_.bounded_scopes_;
}

std::vector<std::byte> PeerMesh::recv_control(int src, Clock::time_point deadline) {
  return recv_on(kControlChannel, src, false, deadline);
}

std::string PeerMesh::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

const Socket& PeerMesh::peer_socket(int peer) const {
  FULCRUM_CHECK(peer >= 0 && peer < size() && peer != rank_, "peer {} outside the world of {} (or self)", peer, size());
  return peers_[peer]->socket;
}

PeerMesh::~PeerMesh() {
  if (acceptor_.joinable()) {
    {
      std::lock_guard lock(mutex_);
      closing_ = true;
    }
    acceptor_.join();  // no readmission from here on
  }
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
