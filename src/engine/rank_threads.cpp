#include "engine/rank_threads.hpp"

#include "comm/in_process_communicator.hpp"
#include "eplb/error.hpp"

namespace fulcrum::engine {

RankThreads::RankThreads(int num_ranks) : num_ranks_(num_ranks), local_errors_(static_cast<size_t>(num_ranks)) {
  FULCRUM_CHECK(num_ranks >= 1, "an in-process world needs at least one rank, got {}", num_ranks);
  world_ = std::thread([this] {
    std::exception_ptr error;
    try {
      comm::run_in_process(num_ranks_, [this](int rank, comm::Communicator& world) { rank_loop(rank, world); });
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard lock(mutex_);
    world_error_ = error;
    world_ended_ = true;
    wake_caller_.notify_all();
  });
}

RankThreads::~RankThreads() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_ranks_.notify_all();
  world_.join();
}

void RankThreads::rank_loop(int rank, comm::Communicator& world) {
  uint64_t seen = 0;
  for (;;) {
    Command command;
    bool local = false;
    {
      std::unique_lock lock(mutex_);
      wake_ranks_.wait(lock, [&] { return generation_ != seen || stopping_ || failed_; });
      if (failed_ || generation_ == seen) return;  // another rank failed, or stopping with nothing left to run
      seen = generation_;
      command = command_;
      local = local_;
    }
    try {
      command(rank, world);
    } catch (...) {
      if (!local) {
        {
          std::lock_guard lock(mutex_);
          failed_ = true;
        }
        wake_ranks_.notify_all();  // ranks waiting for the next command stop too
        throw;                     // run_in_process aborts the world's collectives
      }
      local_errors_[static_cast<size_t>(rank)] = std::current_exception();
    }
    std::lock_guard lock(mutex_);
    if (++num_done_ == num_ranks_) wake_caller_.notify_all();
  }
}

void RankThreads::dispatch(const Command& command, bool local) {
  std::unique_lock lock(mutex_);
  const auto rethrow_failure = [&] {
    if (world_error_) std::rethrow_exception(world_error_);
    throw Error("the engine's rank threads have stopped");
  };
  if (world_ended_) rethrow_failure();
  command_ = command;
  local_ = local;
  num_done_ = 0;
  std::fill(local_errors_.begin(), local_errors_.end(), nullptr);
  ++generation_;
  wake_ranks_.notify_all();
  wake_caller_.wait(lock, [&] { return num_done_ == num_ranks_ || world_ended_; });
  if (num_done_ != num_ranks_) rethrow_failure();
}

void RankThreads::run(const Command& command) { dispatch(command, false); }

std::vector<std::exception_ptr> RankThreads::run_local(const Command& command) {
  dispatch(command, true);
  std::lock_guard lock(mutex_);
  return local_errors_;
}

}  // namespace fulcrum::engine
