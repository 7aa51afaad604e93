#include "comm/in_process_communicator.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>

#include "eplb/error.hpp"

namespace fulcrum::comm {
namespace {

struct Aborted : Error {
  Aborted() : Error("in-process group aborted: another rank failed") {}
};

// A reusable barrier that a failing rank can abort, so the other ranks throw instead of hanging.
class AbortableBarrier {
 public:
  explicit AbortableBarrier(int count) : count_(count) {}
  void arrive_and_wait(const std::atomic<bool>& aborted) {
    std::unique_lock lock(mutex_);
    if (aborted) throw Aborted();
    const uint64_t generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation || aborted; });
    if (generation_ == generation) throw Aborted();
  }
  void wake_all() {
    std::lock_guard lock(mutex_);
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int count_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

struct World;

// State shared by the ranks of one group: per-rank slots where each collective publishes its buffers.
struct Group {
  Group(World* w, std::vector<int> world_ranks)
      : world(w), members(std::move(world_ranks)), barrier(static_cast<int>(members.size())),
        in(members.size()), out(members.size()), counts(members.size()), ints(members.size() * 2),
        split_result(members.size()) {}
  World* world;
  std::vector<int> members;  // world rank of each group rank
  AbortableBarrier barrier;
  std::vector<const std::byte*> in;
  std::vector<std::byte*> out;
  std::vector<const int64_t*> counts;
  std::vector<int> ints;
  std::vector<std::shared_ptr<Group>> split_result;
};

struct Mailbox {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<std::vector<std::byte>> messages;
};

struct World {
  explicit World(int n) : num_ranks(n) {}
  int num_ranks;
  std::atomic<bool> aborted{false};
  std::mutex mutex;
  std::vector<std::weak_ptr<Group>> groups;
  std::map<std::pair<int, int>, Mailbox> mailboxes;  // (sender, receiver) world ranks

  Mailbox& mailbox(int from, int to) {
    std::lock_guard lock(mutex);
    return mailboxes[{from, to}];
  }
  void add_group(const std::shared_ptr<Group>& g) {
    std::lock_guard lock(mutex);
    groups.push_back(g);
  }
  void abort() {
    std::lock_guard lock(mutex);
    aborted = true;
    for (auto& weak : groups) {
      if (auto g = weak.lock()) g->barrier.wake_all();
    }
    for (auto& [key, box] : mailboxes) {
      std::lock_guard box_lock(box.mutex);
      box.cv.notify_all();
    }
  }
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<World> world, std::shared_ptr<Group> group, int rank)
      : world_(std::move(world)), group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(group_->members.size()); }

  void all_reduce_sum(std::span<float> data) override {
    group_->in[rank_] = reinterpret_cast<const std::byte*>(data.data());
    sync();
    std::vector<float> result(data.size(), 0.0f);
    for (int r = 0; r < size(); ++r) {
      const auto* src = reinterpret_cast<const float*>(group_->in[r]);
      for (size_t i = 0; i < data.size(); ++i) result[i] += src[i];
    }
    sync();
    std::copy(result.begin(), result.end(), data.begin());
  }

  void all_gather(std::span<const std::byte> send, std::span<std::byte> recv) override {
    FULCRUM_CHECK(recv.size() == send.size() * size(), "all_gather: recv has {} bytes, expected {} x {}", recv.size(),
                  size(), send.size());
    std::vector<int64_t> counts(size(), static_cast<int64_t>(send.size()));
    all_gather_v(send, recv, counts);
  }

  void all_gather_v(std::span<const std::byte> send, std::span<std::byte> recv,
                    std::span<const int64_t> recv_counts) override {
    FULCRUM_CHECK(static_cast<int>(recv_counts.size()) == size() && recv_counts[rank_] == static_cast<int64_t>(send.size()),
                  "all_gather_v: counts do not match this rank's {} bytes", send.size());
    FULCRUM_CHECK(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0}) <= static_cast<int64_t>(recv.size()),
                  "all_gather_v: recv buffer of {} bytes is too small", recv.size());
    group_->in[rank_] = send.data();
    sync();
    size_t offset = 0;
    for (int r = 0; r < size(); ++r) {
      if (recv_counts[r] > 0) std::memcpy(recv.data() + offset, group_->in[r], recv_counts[r]);
      offset += recv_counts[r];
    }
    sync();
  }

  void reduce_scatter_sum(std::span<const float> send, std::span<float> recv) override {
    FULCRUM_CHECK(send.size() == recv.size() * size(), "reduce_scatter: send has {} floats, expected {} x {}",
                  send.size(), size(), recv.size());
    group_->in[rank_] = reinterpret_cast<const std::byte*>(send.data());
    sync();
    std::fill(recv.begin(), recv.end(), 0.0f);
    for (int r = 0; r < size(); ++r) {
      const auto* src = reinterpret_cast<const float*>(group_->in[r]) + static_cast<size_t>(rank_) * recv.size();
      for (size_t i = 0; i < recv.size(); ++i) recv[i] += src[i];
    }
    sync();
  }

  void all_to_all_v(std::span<const std::byte> send, std::span<const int64_t> send_counts, std::span<std::byte> recv,
                    std::span<const int64_t> recv_counts) override {
    FULCRUM_CHECK(static_cast<int>(send_counts.size()) == size() && static_cast<int>(recv_counts.size()) == size(),
                  "all_to_all_v: counts must have one entry per rank ({})", size());
    FULCRUM_CHECK(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0}) <= static_cast<int64_t>(recv.size()),
                  "all_to_all_v: recv buffer of {} bytes is too small", recv.size());
    group_->in[rank_] = send.data();
    group_->counts[rank_] = send_counts.data();
    sync();
    // Other ranks read this rank's buffers until the second sync: report a mismatch only after it.
    std::string mismatch;
    size_t recv_offset = 0;
    for (int r = 0; r < size(); ++r) {
      const int64_t* their_counts = group_->counts[r];
      const int64_t offset = std::accumulate(their_counts, their_counts + rank_, int64_t{0});
      if (their_counts[rank_] != recv_counts[r]) {
        mismatch = fmt::format("all_to_all_v: rank {} sends {} bytes to rank {}, which expects {}", r,
                               their_counts[rank_], rank_, recv_counts[r]);
      } else if (recv_counts[r] > 0) {
        std::memcpy(recv.data() + recv_offset, group_->in[r] + offset, recv_counts[r]);
      }
      recv_offset += recv_counts[r];
    }
    sync();
    if (!mismatch.empty()) throw Error(mismatch);
  }

  void broadcast(std::span<std::byte> data, int root) override {
    FULCRUM_CHECK(root >= 0 && root < size(), "broadcast: root {} out of range", root);
    group_->out[rank_] = data.data();
    sync();
    if (rank_ != root && !data.empty()) std::memcpy(data.data(), group_->out[root], data.size());
    sync();
  }

  void barrier() override { sync(); }

  void send(std::span<const std::byte> data, int peer) override {
    Mailbox& box = world_->mailbox(group_->members[rank_], group_->members.at(peer));
    std::lock_guard lock(box.mutex);
    box.messages.emplace_back(data.begin(), data.end());
    box.cv.notify_all();
  }

  void recv(std::span<std::byte> data, int peer) override {
    Mailbox& box = world_->mailbox(group_->members.at(peer), group_->members[rank_]);
    std::unique_lock lock(box.mutex);
    box.cv.wait(lock, [&] { return !box.messages.empty() || world_->aborted; });
    if (box.messages.empty()) throw Aborted();
    std::vector<std::byte> message = std::move(box.messages.front());
    box.messages.pop_front();
    FULCRUM_CHECK(message.size() == data.size(), "recv from rank {}: got {} bytes, expected {}", peer, message.size(),
                  data.size());
    std::copy(message.begin(), message.end(), data.begin());
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    group_->ints[2 * rank_] = color;
    group_->ints[2 * rank_ + 1] = key;
    sync();
    std::vector<int> same;  // group ranks with my color, ordered by (key, rank)
    for (int r = 0; r < size(); ++r) {
      if (group_->ints[2 * r] == color) same.push_back(r);
    }
    std::stable_sort(same.begin(), same.end(), [&](int a, int b) { return group_->ints[2 * a + 1] < group_->ints[2 * b + 1]; });
    const int leader = *std::min_element(same.begin(), same.end());
    if (rank_ == leader) {
      std::vector<int> world_ranks;
      for (int r : same) world_ranks.push_back(group_->members[r]);
      auto group = std::make_shared<Group>(world_.get(), std::move(world_ranks));
      world_->add_group(group);
      group_->split_result[leader] = group;
    }
    sync();
    std::shared_ptr<Group> mine = group_->split_result[leader];
    const int new_rank = static_cast<int>(std::find(same.begin(), same.end(), rank_) - same.begin());
    sync();
    if (rank_ == leader) group_->split_result[leader].reset();
    return std::make_unique<InProcessCommunicator>(world_, std::move(mine), new_rank);
  }

 private:
  void sync() { group_->barrier.arrive_and_wait(world_->aborted); }

  std::shared_ptr<World> world_;
  std::shared_ptr<Group> group_;
  int rank_;
};

}  // namespace

namespace {

std::pair<std::shared_ptr<World>, std::vector<std::unique_ptr<Communicator>>> create_world(int num_ranks) {
  FULCRUM_CHECK(num_ranks >= 1, "an in-process world needs at least one rank, got {}", num_ranks);
  auto world = std::make_shared<World>(num_ranks);
  std::vector<int> members(num_ranks);
  std::iota(members.begin(), members.end(), 0);
  auto group = std::make_shared<Group>(world.get(), members);
  world->add_group(group);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < num_ranks; ++r) comms.push_back(std::make_unique<InProcessCommunicator>(world, group, r));
  return {world, std::move(comms)};
}

}  // namespace

void run_in_process(int num_ranks, const std::function<void(int, Communicator&)>& fn) {
  auto [world, comms] = create_world(num_ranks);
  std::vector<std::exception_ptr> errors(num_ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < num_ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, *comms[r]);
      } catch (const Aborted&) {
        // another rank failed first; its error is the one reported
      } catch (...) {
        errors[r] = std::current_exception();
        world->abort();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace fulcrum::comm
