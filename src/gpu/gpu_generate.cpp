#include "gpu/gpu_generate.hpp"

#include <chrono>
#include <string>

#include "eplb/error.hpp"
#include "model/rng.hpp"
#include "model/sampling.hpp"

namespace fulcrum::gpu {
namespace {

struct PrefillChunk {
  size_t seq = 0, offset = 0, count = 0;
  bool last = false;  // the prompt's last chunk
};

// The next prefill step: chunks of the prompts from `next` on, within the step's token budget and sequence count;
// advances `cursor` (tokens of each prompt taken) and `next` (the first prompt not yet whole).
std::vector<PrefillChunk> next_prefill_step(const std::vector<std::vector<int32_t>>& prompts, std::vector<size_t>& cursor,
                                            size_t& next, int64_t budget, int max_seqs) {
  std::vector<PrefillChunk> step;
  int64_t used = 0;
  for (size_t i = next; i < prompts.size() && used < budget && static_cast<int>(step.size()) < max_seqs; ++i) {
    const size_t left = prompts[i].size() - cursor[i];
    if (left == 0) continue;
    const size_t take_n = std::min<size_t>(left, static_cast<size_t>(budget - used));
    step.push_back({i, cursor[i], take_n, take_n == left});
    used += static_cast<int64_t>(take_n);
    cursor[i] += take_n;
  }
  while (next < prompts.size() && cursor[next] == prompts[next].size()) ++next;
  return step;
}

}  // namespace

int64_t gpu_prefill_steps(const std::vector<std::vector<int32_t>>& prompts, int64_t max_batch_tokens, int max_batch_seqs) {
  std::vector<size_t> cursor(prompts.size(), 0);
  int64_t steps = 0;
  for (size_t next = 0; next < prompts.size(); ++steps) next_prefill_step(prompts, cursor, next, max_batch_tokens, max_batch_seqs);
  return steps;
}

model::GenerateResult gpu_generate(GpuEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                   const model::DecodeOptions& options, bool prompt_logits, GpuGenerateStats* stats,
                                   const GpuGenerateRank* rank) {
  using clock = std::chrono::steady_clock;
  model::validate_sampling_params(options.sampling);
  const size_t n = prompts.size();
  FULCRUM_CHECK(rank == nullptr || rank->sequence_index.size() == n, "generate: {} sequence indices for {} prompts",
                rank == nullptr ? 0 : rank->sequence_index.size(), n);
  FULCRUM_CHECK(n > 0 || rank != nullptr, "generate: no prompts");
  std::vector<model::Rng> rngs;
  for (size_t i = 0; i < n; ++i) {
    rngs.emplace_back(options.seed, "sequence " + std::to_string(rank != nullptr ? rank->sequence_index[i] : i));
  }
  const bool draws = options.sampling.temperature > 0.0f;
  model::GenerateResult result;
  result.new_tokens.assign(n, {});
  if (prompt_logits) result.prompt_logits.assign(n, model::HostTensor{{0, engine.vocab_size()}, {}});
  for (size_t i = 0; i < n; ++i) {
    FULCRUM_CHECK(!prompts[i].empty(), "prompt {} is empty", i);
    engine.allocate(static_cast<model::SequenceId>(i), static_cast<int64_t>(prompts[i].size()) + options.max_new_tokens);
  }
  struct Releaser {  // every sequence's pages go back, also when a step throws
    GpuEngine& engine;
    size_t n;
    ~Releaser() {
      for (size_t i = 0; i < n; ++i) engine.release(static_cast<model::SequenceId>(i));
    }
  } releaser{engine, n};

  const auto entry = [&](size_t i, std::span<const int32_t> tokens, bool sample) {
    model::StepSequence seq;
    seq.id = static_cast<model::SequenceId>(i);
    seq.token_ids = tokens;
    seq.sample = sample;
    seq.sampling = options.sampling;
    if (sample && draws && !prompt_logits) seq.uniform = rngs[i].uniform();
    return seq;
  };
  const auto take = [&](const model::StepOutput& out, const std::vector<size_t>& members,
                        const std::vector<model::StepSequence>& batch) {
    for (size_t k = 0; k < batch.size(); ++k) {
      if (!batch[k].sample) continue;
      FULCRUM_CHECK(out.errors[k].empty(), "sequence {}: {}", members[k], out.errors[k]);
      result.new_tokens[members[k]].push_back(out.tokens[k]);
    }
  };

  const auto after_step = [rank] {
    if (rank != nullptr && rank->after_step) rank->after_step();
  };

  // Prefill: chunks of at most the step's token budget; a prompt's last chunk samples its first new token.
  const auto t0 = clock::now();
  const int64_t budget = engine.options().max_batch_tokens;
  const bool sample_first = options.max_new_tokens > 0;
  std::vector<size_t> cursor(n, 0);
  int64_t prefill_steps = 0;
  for (size_t next = 0; next < n || (rank != nullptr && prefill_steps < rank->prefill_steps); ++prefill_steps) {
    std::vector<model::StepSequence> batch;
    std::vector<size_t> members;
    // Past this rank's own prompts (EP lockstep): an empty step, which joins the other ranks' exchanges.
    if (next < n) {
      for (const PrefillChunk& c : next_prefill_step(prompts, cursor, next, budget, engine.options().max_batch_seqs)) {
        batch.push_back(entry(c.seq, std::span<const int32_t>(prompts[c.seq]).subspan(c.offset, c.count), c.last && sample_first));
        members.push_back(c.seq);
      }
    }
    if (!prompt_logits) {
      take(engine.step(batch), members, batch);
      after_step();
      continue;
    }
    const std::vector<model::HostTensor> logits = engine.forward_logits(batch);
    after_step();
    for (size_t k = 0; k < batch.size(); ++k) {
      model::HostTensor& all = result.prompt_logits[members[k]];
      all.shape[0] += logits[k].shape[0];
      all.data.insert(all.data.end(), logits[k].data.begin(), logits[k].data.end());
      if (!batch[k].sample) continue;
      const std::span<const float> last(logits[k].data.data() + logits[k].data.size() - engine.vocab_size(),
                                        static_cast<size_t>(engine.vocab_size()));
      const double u = draws ? rngs[members[k]].uniform() : 0.0;
      result.new_tokens[members[k]].push_back(model::sample_token_from_uniform(last, options.sampling, u));
    }
  }
  const auto t1 = clock::now();

  // Decode: every sequence one token a step.
  int64_t steps = 0;
  for (int step = 1; step < options.max_new_tokens; ++step) {
    std::vector<model::StepSequence> batch;
    std::vector<size_t> members;
    for (size_t i = 0; i < n; ++i) {
      batch.push_back(entry(i, std::span<const int32_t>(&result.new_tokens[i].back(), 1), true));
      members.push_back(i);
    }
    take(engine.step(batch), members, batch);
    after_step();
    ++steps;
  }
  if (stats != nullptr) {
    stats->prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
    stats->decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
    stats->decode_steps = steps;
  }
  return result;
}

}  // namespace fulcrum::gpu
