#pragma once
// N ranks as threads of one process sharing memory: the Communicator the CPU engine and tests run on.
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.hpp"

namespace fulcrum::comm {

// Runs fn(rank, communicator) on num_ranks threads and joins them; the first exception is rethrown
// after every thread has stopped (a failing rank aborts the group so the others do not hang).
void run_in_process(int num_ranks, const std::function<void(int, Communicator&)>& fn);

}  // namespace fulcrum::comm
