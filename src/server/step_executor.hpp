#pragma once
// The one interface through which the server reaches a model: model::StepModel (model/step_model.hpp), a
// ragged batch of sequences in, one sampled token per sampling entry out, plus the lifecycle of each
// sequence's KV cache. The scheduler (scheduler.hpp) is the only caller and calls it from one thread.
//
//   EngineStepExecutor (engine_step_executor.hpp): the parallel engine (one rank or many, in-process
//   threads) with live EPLB; it samples last-position logits on the host (model::sample_entry).
#include "eplb/error.hpp"
#include "model/step_model.hpp"

namespace fulcrum::server {

using SequenceId = model::SequenceId;
using StepExecutor = model::StepModel;

// Thrown by step() when the executor can run no further step (its ranks stopped after a failure): the
// scheduler then ends every request and stops (Scheduler::run rethrows it). Any other exception from
// step() ends only that step's requests.
class ExecutorFailure : public Error {
 public:
  using Error::Error;
};

// Thrown by step() or allocate_on_pages() (elastic EP) when the executor re-formed its world without a lost
// rank: every KV pool was rebuilt empty and every sequence dropped. The call did nothing; the caller drops
// its page accounting (the prefix cache's index and leases) and runs each live sequence again from its
// tokens so far (prompt, then generated), on pages it chooses anew.
class WorldReformed : public Error {
 public:
  using Error::Error;
};

}  // namespace fulcrum::server
