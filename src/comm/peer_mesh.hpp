#pragma once
// The rank processes of one world, joined over TCP: a rendezvous at --dist-init-addr (world rank 0 serves it)
// where every rank announces (world size, rank, mesh port) and learns every other rank's address, then one
// socket per pair of ranks. Each socket has a reader thread that files incoming messages per (channel,
// sender), so a send never waits for its receiver (the buffered semantics of Communicator::send).
// A peer that exits without saying goodbye (a crash, a kill) is a failure every later receive reports.
// With a liveness timeout every rank also sends a heartbeat to every peer a few times per timeout, so a
// receive from a peer that sent nothing at all (not even a heartbeat) for that long fails instead of
// waiting forever: a stopped or hung process, a cut link. Idle waits on live peers are never cut short.
//
// Elastic worlds (set_elastic): the mesh lives through numbered epochs, each a world over some of its ranks.
// In an epoch, any peer's failure, or an abort from any rank (abort_epoch), ends every data wait of this
// rank, not only the waits on the failed peer: survivors blocked on each other inside a collective all leave
// it instead of hanging. With a liveness timeout, the data waits of a step (inside a BoundedWaits scope: the
// waits of one forward pass, which every rank runs at once) also have a progress bound: a wait on a live peer
// that lasts a whole timeout (its heartbeats arrive, its data does not: a rank whose work stopped, not its
// process) aborts the epoch here and everywhere, and the recovery's roll call finds who stopped. Other waits
// (a worker idle until rank 0's next command, loading, a rebuild) are bounded by liveness only. Control messages
// (send_control / recv_control) are never aborted: the recovery that forms the next epoch's world runs on them.
// Abort frames carry their epoch, so a late one from an epoch that is over is ignored.
//
// Rejoining (DistInit::elastic): every rank keeps its mesh listener, and world rank 0 its rendezvous
// listener, after the world formed. A rank started again after its failure (the same command with its
// rank) says hello at --dist-init-addr as at launch; rank 0 answers "world running" with the mesh addresses
// of the live ranks; the newcomer connects to every live rank but 0, each of which readmits it (a fresh
// socket, reader and mailboxes for that rank), and to rank 0 last, which readmits it and lists it in
// take_rejoined(): rank 0 brings it into the next epoch's world when it chooses (elastic_world.hpp).
// A rank that fails while it is not a member of the current epoch aborts nothing.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "comm/tcp_socket.hpp"

namespace fulcrum::comm {

// In every error about a peer that failed first (how a launcher tells a cause from its consequences).
inline constexpr const char* kPeerFailedPhrase = "closed its connection without finishing";

struct DistInit {
  HostPort address;  // --dist-init-addr: world rank 0 listens here, every other rank connects
  int world_size = 1;
  int rank = 0;
  // How long the rendezvous waits for every rank (and each rank for rank 0) before failing.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  // After the rendezvous: a peer silent this long has failed (0: never; a hung peer then blocks receives).
  std::chrono::milliseconds liveness_timeout{0};
  // Keep listening after the rendezvous, so a failed rank can rejoin (see the top of this file); elastic mode on.
  bool elastic = false;
};

class PeerMesh {
 public:
  // Collective over the world: returns once every pair of ranks is connected. Throws a one-line error on an
  // unreachable address, a timeout, mismatched world sizes, a rank announced twice or out of range.
  static std::shared_ptr<PeerMesh> connect(const DistInit& init);
  // Says goodbye to every peer (so they do not take this rank's exit for a failure) and closes; while an
  // exception unwinds, closes without goodbye: the peers see this rank fail.
  ~PeerMesh();

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(peers_.size()); }

  // Buffered: returns once the bytes are handed to the kernel, whether or not `dst` receives yet.
  void send(uint64_t channel, int dst, std::span<const std::byte> data);
  // The next message from `src` on `channel` (waits); throws when `src` failed or left first.
  std::vector<std::byte> recv(uint64_t channel, int src);
  // Empty while no peer has failed; else one line naming the first peer that did.
  std::string failure() const;
  // Whether `peer` has failed (closed without goodbye, or silent past the liveness timeout).
  bool peer_failed(int peer) const;
  // The connection to `peer` (tests read its options).
  const Socket& peer_socket(int peer) const;

  // Elastic worlds (see the top of this file). Off by default: then a failure ends only waits on that peer.
  void set_elastic(bool on);
  uint64_t epoch() const;
  // Whether this epoch's waits are aborted (a failure seen, or an abort received).
  bool aborted() const;
  // Aborts this epoch's data waits here and tells every live peer to abort theirs.
  void abort_epoch();
  // Starts `epoch` (> the current one) over `members` (mesh ranks): its waits abort again only on a new
  // event, unless a member has failed already.
  void begin_epoch(uint64_t epoch, const std::vector<int>& members);
  // Rejoining (DistInit::elastic). Whether this rank joined a world that was already running (then no
  // epoch's world includes it until rank 0's next roll call, which it answers as a newcomer).
  bool joined_late() const { return joined_late_; }
  // World rank 0: the ranks readmitted since the last call, in the order they came (each once).
  std::vector<int> take_rejoined();
  // Control messages for the recovery: never aborted; a receive from a failed peer throws.
  void send_control(int dst, std::span<const std::byte> data);
  std::vector<std::byte> recv_control(int src);
  // The same, bounded: a peer that is alive (heartbeats arrive) but sends no control message by `deadline` is
  // expelled (marked failed, its connection shut: it sees this rank close) and the receive throws. For the roll
  // call, where a peer that stopped making progress must not hold the recovery forever.
  std::vector<std::byte> recv_control(int src, Clock::time_point deadline);
  // The liveness timeout this mesh runs with (DistInit::liveness_timeout; 0: none).
  std::chrono::milliseconds liveness_timeout() const { return liveness_timeout_; }
  // While one lives, this mesh's data waits have the progress bound (see the top of this file).
  class BoundedWaits {
   public:
    explicit BoundedWaits(PeerMesh& mesh);
    ~BoundedWaits();
    BoundedWaits(const BoundedWaits&) = delete;
    BoundedWaits& operator=(const BoundedWaits&) = delete;

   private:
    PeerMesh& mesh_;
  };

  PeerMesh(const PeerMesh&) = delete;
  PeerMesh& operator=(const PeerMesh&) = delete;

 private:
  enum class PeerState { kConnected, kLeft, kFailed };
  struct Peer {
    Socket socket;
    std::string address;
    std::mutex write_mutex;
    std::thread reader;
    PeerState state = PeerState::kConnected;
    bool reader_done = false;
    Clock::time_point last_heard;  // last frame of any kind (heartbeats included)
  };

  PeerMesh(int rank, int world_size);
  void start_readers();
  void accept_loop();
  // One connection on a kept listener: a rendezvous hello (rank 0) is answered with the live ranks; a mesh
  // hello from a rank that is not connected readmits it.
  void answer_late_rendezvous(Socket s);
  void answer_late_mesh_hello(Socket s);
  // Installs `socket` as the connection to `src` (failed or left before) and starts its reader.
  void readmit(int src, Socket socket, const std::string& address);
  void read_loop(int src);
  void heartbeat_loop();
  // Under mutex_: marks `src` failed when it has been silent past the liveness timeout.
  void check_liveness(int src, Clock::time_point now);

  int rank_;
  std::vector<std::unique_ptr<Peer>> peers_;  // peers_[rank_] is unused
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::pair<uint64_t, int>, std::deque<std::vector<std::byte>>> mailboxes_;  // (channel, src)
  std::string failure_;
  std::chrono::milliseconds liveness_timeout_{0};
  bool closing_ = false;       // stops the heartbeat thread
  bool elastic_ = false;
  uint64_t epoch_ = 0;
  bool aborted_ = false;        // this epoch's data waits end (elastic only)
  int bounded_scopes_ = 0;      // live BoundedWaits scopes
  std::vector<bool> epoch_members_;  // [mesh rank]: in the current epoch's world (a failure aborts it)
  // Under mutex_: `src` failed; in an elastic world that aborts the epoch if `src` is one of its members.
  void on_peer_failed(int src);
  // Rejoining: the listeners kept (rendezvous: rank 0 only), every rank's mesh address (rank 0), the
  // readmitted ranks not yet taken, the thread that accepts.
  Socket mesh_listener_;
  Socket rendezvous_listener_;
  std::vector<HostPort> addresses_;
  std::vector<int> rejoined_;
  bool joined_late_ = false;
  std::thread acceptor_;
  std::vector<std::byte> recv_on(uint64_t channel, int src, bool abortable,
                                 std::optional<Clock::time_point> deadline = std::nullopt);
  // Under mutex_: `src` is out for good (failed, the first failure named `why`, its connection shut).
  void mark_failed(int src, const std::string& why);
  std::thread heartbeat_;
};

}  // namespace fulcrum::comm
