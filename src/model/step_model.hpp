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
  int top_logprobs = 0;                // in [0, kMaxTopLogprobs]: also report the top_logprobs most likely
                                       // tokens of each row that reports a logprob (sampled or prompt)
  // Prompt logprobs (OpenAI echo, SGLang input_token_logprobs): the prompt tokens that this chunk's last
  // non-sampling rows predict. With n = token_ids.size() and n_pred = n - (sample ? 1 : 0) (the sampling row
  // predicts nothing known), targets[j] is the token after row n_pred - size + j: a later token of this chunk,
  // or, for the last row of a chunk that does not sample, the next chunk's first. size <= n_pred. Empty (every
  // request that does not ask): the step computes the LM head for the sampling row only.
  std::span<const int32_t> prompt_targets;
};

// The largest top_logprobs an engine reports (OpenAI's chat limit; its completions limit is 5).
inline constexpr int kMaxTopLogprobs = 20;

// One row's logprob of a given token and, when asked, its most likely tokens. All values are log-softmax at
// temperature 1 over the full vocabulary, each logit - max - log(sum exp(logit - max)) with the sum in double,
// so a token's value is the same float wherever it appears (the token's own and a top entry).
struct TokenLogprob {
  float logprob = 0.0f;
  std::vector<int32_t> top_ids;     // [top_logprobs] descending logprob, lower id first on ties
  std::vector<float> top_logprobs;  // [top_logprobs]
};

// Per batch entry, in batch order; each vector has the batch's length (make_step_output).
struct StepOutput {
  std::vector<int32_t> tokens;      // sampled token in [0, vocab_size); -1 where !sample or sampling failed
  std::vector<float> logprobs;      // NaN where not asked or not sampled
  // The sampled token's top_logprobs most likely tokens (empty where not asked or not sampled; the same
  // TokenLogprob::top_* fields, logprob unused).
  std::vector<TokenLogprob> top_logprobs;
  // [prompt_targets.size()] per entry: logprob of each prompt target given its prefix, with its row's top.
  std::vector<std::vector<TokenLogprob>> prompt_logprobs;
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
  // Positions [0, num_cached_tokens) already hold K/V of the sequence's first tokens, and the first step
  // appends after them. Less than capacity. Its first num_cached_tokens / page_size pages were written by an
  // earlier sequence in an earlier step (the GPU engine's decode attention reads them before its kernel's
  // dependency wait); they are read, never written again.
  int64_t num_cached_tokens = 0;
  // Copy on write of a partly shared page: when num_cached_tokens % page_size = r > 0, the allocation first
  // copies rows [0, r) of pool page copy_source_page (cached, not in page_ids) into the sequence's own page
  // page_ids[num_cached_tokens / page_size], on every layer and rank of the group, ordered before any later
  // step. -1 exactly when r = 0. The caller keeps the source page unchanged until the next step has run.
  int32_t copy_source_page = -1;
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

  // Whether step() honours StepSequence::prompt_targets (the LM head over prompt rows); a caller refuses
  // prompt logprobs where not (the GPU engine, for now).
  virtual bool supports_prompt_logprobs() const { return true; }
};

// An output for `num_entries` entries with nothing sampled: tokens -1, logprobs NaN, tops, prompt logprobs and
// errors empty.
StepOutput make_step_output(size_t num_entries);

// The host implementation of StepSequence's sampling over one row of logits [vocab_size] (what an engine
// that produces logits calls): fills output entry `entry_idx` of `out` (made by make_step_output) from
// `logits`. Does nothing when !seq.sample. Otherwise the token is sample_token_from_uniform(logits,
// seq.sampling, seq.uniform), its logprob (when asked) logit[token] - max - log(sum exp(logit - max)) with
// the sum in double, and its top (seq.top_logprobs > 0, with want_logprob); on a failure the token stays -1 and
// errors[entry_idx] holds the one-line reason.
void sample_entry(std::span<const float> logits, const StepSequence& seq, StepOutput& out, size_t entry_idx);

// The host implementation of StepSequence::prompt_targets: `rows` holds the logits of the entry's last
// prompt_targets.size() non-sampling rows, [size, vocab_size]; fills out.prompt_logprobs[entry_idx]. A row
// without a finite maximum throws.
void prompt_entry(std::span<const float> rows, const StepSequence& seq, StepOutput& out, size_t entry_idx);

// log_softmax(logits)[token] and the top `num_top` tokens (descending, lower id on ties; -inf logits are
// never listed while finite ones remain), every value by the formula of TokenLogprob. num_top in
// [0, kMaxTopLogprobs] (clipped to the vocabulary). Requires a finite maximum.
TokenLogprob token_logprob_with_top(std::span<const float> logits, int32_t token, int num_top);

// log_softmax(logits)[token] at temperature 1 over every logit; -inf logits add nothing to the sum.
// Requires a finite maximum (what sample_token_from_uniform checks).
float token_logprob(std::span<const float> logits, int32_t token);

}  // namespace fulcrum::model
