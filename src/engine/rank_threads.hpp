#pragma once
// The ranks of an in-process world (comm::run_in_process) as long-lived threads that run commands: a
// server keeps its engine's ranks alive between forward passes. Every rank runs every command, in the
// order given; the caller waits until all of them are done.
//
// Failure: an exception in a collective command (run) aborts the world, so ranks blocked in a collective
// throw instead of hanging; every thread then stops and run() rethrows the failing rank's error, as every
// later call does. Commands without collectives (run_local) report each rank's exception instead and the
// world goes on.
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"

namespace fulcrum::engine {

class RankThreads {
 public:
  using Command = std::function<void(int rank, comm::Communicator& world)>;

  explicit RankThreads(int num_ranks);
  // Stops the threads (after the command in flight, if any) and joins them.
  ~RankThreads();
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  int num_ranks() const { return num_ranks_; }

  // Runs `command` on every rank (collective). Not reentrant: one caller thread.
  void run(const Command& command);
  // Runs `command` on every rank; it must not use `world`. Returns each rank's exception (null: none).
  std::vector<std::exception_ptr> run_local(const Command& command);

 private:
  void rank_loop(int rank, comm::Communicator& world);
  void dispatch(const Command& command, bool local);

  const int num_ranks_;
  std::mutex mutex_;
  std::condition_variable wake_ranks_, wake_caller_;
  Command command_;
  bool local_ = false;
  uint64_t generation_ = 0;  // commands issued
  int num_done_ = 0;         // ranks done with the current command
  std::vector<std::exception_ptr> local_errors_;
  bool stopping_ = false;
  bool failed_ = false;      // a collective command threw on some rank
  bool world_ended_ = false; // every rank thread has returned
  std::exception_ptr world_error_;
  std::thread world_;
};

}  // namespace fulcrum::engine
