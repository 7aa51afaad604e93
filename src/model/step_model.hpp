#pragma once
// The step interface between the server and a model: a ragged batch in, sampled tokens out. Every engine
// implements it: the CPU parallel engine (server::EngineStepExecutor, which computes last-position logits
// on the host and samples them with sample_entry below) and the GPU-resident engine (which samples on the
// device). The caller (server::Scheduler) calls it from one thread; implementations need not be thread-safe.
//
// Randomness stays with the caller: a sequence's Rng lives in the scheduler, which draws the one uniform a
// sampled token needs (only when sample && sampling.temperature > 0, exactly the draws model::sample_token
// makes) and passes it in StepSequence::uniform. So every engine gives the same tokens for the same seed,
// and a model never holds per-request random state.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/sampling.hpp"

namespace fulcrum::model {

using SequenceId = int64_t;

// One sequence's part of a step. A prefill chunk has one or more prompt tokens; a decode step has exactly
// the last sampled token.
struct StepSequence {
  SequenceId id = 0;
  std::span<const int32_t> token_ids;  // new tokens appended after what its cache holds; non-empty; valid
                                       // for the duration of step()
  bool sample = false;                 // sample one token after the last new token (false: a prompt chunk
                                       // that is not the prompt's last)
  SamplingParams sampling;             // used when sample
  double uniform = 0.0;                // in [0, 1): the draw when sample && sampling.temperature > 0, taken
                                       // by the caller from the sequence's own Rng; ignored otherwise
  bool want_logprob = false;           // also report the sampled token's logprob (log-softmax at
                                       // temperature 1 over the full vocabulary)
};

// Per batch entry, in batch order; each vector has the batch's length (make_step_output).
struct StepOutput {
  std::vector<int32_t> tokens;      // sampled token in [0, vocab_size); -1 where !sample or sampling failed
  std::vector<float> logprobs;      // NaN where not asked or not sampled
  std::vector<std::string> errors;  // empty, or a one-line reason this entry could not sample (e.g.
                                    // "sampling: logit of token 3 is nan"); the other entries are valid
};

// Where a new sequence's KV lives when the caller chooses its pages (StepModel::allocate_on_pages): the
// server's scheduler does, so that its prefix cache (server/prefix_cache.hpp) can share the pages that hold
// a common prompt prefix between sequences. Page ids index the pool of the sequence's attention-DP group
// (every rank of that group holds the same page ids in its own pool).
struct SequencePages {
  int64_t capacity = 0;               // positions the sequence holds at most (prompt + generated)
  int dp_group = 0;                   // in [0, num_kv_groups())
  std::span<const int32_t> page_ids;  // ceil(capacity / page_size) distinct pages, in position order
  // Positions [0, num_cached_tokens) already hold K/V of the sequence's first tokens, written by an earlier
  // sequence into page_ids' first pages (a whole number of pages); they are read, never written again, and
  // the first step appends after them. Less than capacity.
  int64_t num_cached_tokens = 0;
};

class StepModel {
 public:
  virtual ~StepModel() = default;

  virtual int vocab_size() const = 0;
  // Longest sequence (prompt + generated) the model accepts.
  virtual int64_t max_sequence_length() const = 0;

  // Creates the KV state of a new sequence that will hold at most `capacity` tokens in total.
  // `id` must not be live. Throws fulcrum::Error when it cannot (the model stays usable).
  virtual void allocate(SequenceId id, int64_t capacity) = 0;
  // The same over pages chosen by the caller (see SequencePages), who then owns page accounting; the pool
  // of each group must hold every page id the caller uses (its --kv-pages, of the caller's page size).
  virtual void allocate_on_pages(SequenceId id, const SequencePages& pages) = 0;
  // Attention-DP groups, each with its own KV pool (1 unless the engine runs DP attention).
  virtual int num_kv_groups() const { return 1; }
  // Drops the KV state of `id`; a no-op for an id that is not live.
  virtual void release(SequenceId id) = 0;

  // Runs one forward pass over `batch` (each id live and at most once, its tokens fitting its capacity)
  // and samples a token for every entry that asks. A sequence's token depends only on its own tokens, its
  // sampling parameters and its uniform, never on the rest of the batch. A sampling failure of one entry
  // (non-finite logits) is reported in StepOutput::errors; anything else that fails throws.
  virtual StepOutput step(std::span<const StepSequence> batch) = 0;
};

// An output for `num_entries` entries with nothing sampled: tokens -1, logprobs NaN, errors empty.
StepOutput make_step_output(size_t num_entries);

// The host implementation of StepSequence's sampling over one row of logits [vocab_size] (what an engine
// that produces logits calls): fills output entry `entry_idx` of `out` (made by make_step_output) from
// `logits`. Does nothing when !seq.sample. Otherwise the token is sample_token_from_uniform(logits,
// seq.sampling, seq.uniform), its logprob (when asked) logit[token] - max - log(sum exp(logit - max)) with
// the sum in double; on a failure the token stays -1 and errors[entry_idx] holds the one-line reason.
void sample_entry(std::span<const float> logits, const StepSequence& seq, StepOutput& out, size_t entry_idx);

// log_softmax(logits)[token] at temperature 1 over every logit; -inf logits add nothing to the sum.
// Requires a finite maximum (what sample_token_from_uniform checks).
float token_logprob(std::span<const float> logits, int32_t token);

}  // namespace fulcrum::model
