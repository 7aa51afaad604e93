#pragma once
// The one interface through which the server reaches a model: a forward step over a batch of sequences
// plus the lifecycle of each sequence's KV cache. The scheduler (scheduler.hpp) is the only caller and
// calls it from one thread; implementations need not be thread-safe.
//
//   EngineStepExecutor (engine_step_executor.hpp): the parallel engine (one rank or many, in-process
//   threads) with live EPLB.
#include <cstdint>
#include <span>
#include <vector>

#include "eplb/error.hpp"

namespace fulcrum::server {

using SequenceId = int64_t;

// Thrown by step() when the executor can run no further step (its ranks stopped after a failure): the
// scheduler then ends every request and stops (Scheduler::run rethrows it).
class ExecutorFailure : public Error {
 public:
  using Error::Error;
};

// One sequence's part of a step: the new tokens appended after what its cache holds. A prefill chunk has
// one or more prompt tokens; a decode step has exactly the last sampled token.
struct StepInput {
  SequenceId id = 0;
  std::span<const int32_t> token_ids;  // non-empty; valid for the duration of step()
};

class StepExecutor {
 public:
  virtual ~StepExecutor() = default;

  virtual int vocab_size() const = 0;
  // Longest sequence (prompt + generated) the model accepts.
  virtual int64_t max_sequence_length() const = 0;

  // Creates the KV state of a new sequence that will hold at most `capacity` tokens in total.
  // `id` must not be live. Throws fulcrum::Error when it cannot (the executor stays usable).
  virtual void allocate(SequenceId id, int64_t capacity) = 0;
  // Drops the KV state of `id`; a no-op for an id that is not live.
  virtual void release(SequenceId id) = 0;

  // Runs one forward pass over `batch` (each id live and at most once, its tokens fitting its capacity)
  // and returns, per entry in batch order, the logits [vocab_size] at the last new position. A sequence's
  // logits depend only on its own tokens, never on the rest of the batch.
  virtual std::vector<std::vector<float>> step(std::span<const StepInput> batch) = 0;
};

}  // namespace fulcrum::server
