#include "server/scheduler.hpp"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "eplb/error.hpp"
#include "server/api_error.hpp"

namespace fulcrum::server {
namespace {

// Whether a request needs logits of prompt rows (a prompt position >= 1 it wants the logprob of).
bool wants_prompt_rows(const RequestParams& params) {
  return params.prompt_logprobs_from >= 0 && params.prompt_logprobs_from < static_cast<int64_t>(params.prompt.size());
}

}  // namespace

Scheduler::Scheduler(StepExecutor& executor, SchedulerOptions options, Detokenizer detokenizer, ServerMetrics* metrics)
    : executor_(executor), options_(options), detokenizer_(std::move(detokenizer)), metrics_(metrics) {
  FULCRUM_CHECK(options.max_running_requests > 0, "max running requests must be positive, got {}",
                options.max_running_requests);
  FULCRUM_CHECK(options.kv_pages > 0, "KV pages must be positive, got {}", options.kv_pages);
  FULCRUM_CHECK(options.page_size > 0, "page size must be positive, got {}", options.page_size);
  FULCRUM_CHECK(options.max_prefill_tokens > 0, "max prefill tokens must be positive, got {}",
                options.max_prefill_tokens);
  const int groups = executor.num_kv_groups();
  FULCRUM_CHECK(groups >= 1, "the executor has {} KV groups", groups);
  for (int g = 0; g < groups; ++g) {
    caches_.push_back(std::make_unique<PrefixCache>(options.kv_pages, options.page_size, options.prefix_cache));
  }
  group_running_.assign(static_cast<size_t>(groups), 0);
}

int64_t Scheduler::pages_for(const RequestParams& params) const {
  const int64_t tokens = static_cast<int64_t>(params.prompt.size()) + params.max_tokens;
  return (tokens + options_.page_size - 1) / options_.page_size;
}

std::shared_ptr<RequestHandle> Scheduler::submit(RequestParams params) {
  FULCRUM_REQUIRE(!params.prompt.empty(), "the prompt is empty");
  const int vocab = executor_.vocab_size();
  for (const int32_t id : params.prompt) FULCRUM_REQUIRE(id >= 0 && id < vocab, "token id {} outside [0, {})", id, vocab);
  FULCRUM_REQUIRE(params.max_tokens >= 1, "max_tokens must be at least 1, got {}", params.max_tokens);
  try {
    model::validate_sampling_params(params.sampling);
  } catch (const Error& e) {
    throw ApiError(400, "invalid_request_error", e.what());
  }
  FULCRUM_REQUIRE(params.top_logprobs >= 0 && params.top_logprobs <= model::kMaxTopLogprobs,
                  "top logprobs must be in [0, {}], got {}", model::kMaxTopLogprobs, params.top_logprobs);
  FULCRUM_REQUIRE(params.prompt_logprobs_from == -1 ||
                      (params.prompt_logprobs_from >= 1 &&
                       params.prompt_logprobs_from <= static_cast<int64_t>(params.prompt.size())),
                  "prompt logprobs from position {} of a {}-token prompt", params.prompt_logprobs_from,
                  params.prompt.size());
  FULCRUM_REQUIRE(!wants_prompt_rows(params) || executor_.supports_prompt_logprobs(),
                  "prompt logprobs (echo with logprobs, or logprob_start_len inside the prompt) are not implemented "
                  "by this engine (the GPU engine runs the LM head on sampled rows only)");
  FULCRUM_REQUIRE(params.stop.empty() || detokenizer_, "stop strings need a tokenizer; this server has none");
  for (const std::string& s : params.stop) FULCRUM_REQUIRE(!s.empty(), "stop strings must not be empty");
  const int64_t length = static_cast<int64_t>(params.prompt.size()) + params.max_tokens;
  FULCRUM_REQUIRE(length <= executor_.max_sequence_length(),
                  "prompt ({} tokens) + max_tokens ({}) exceeds the model's {} positions", params.prompt.size(),
                  params.max_tokens, executor_.max_sequence_length());
  const int64_t pages = pages_for(params);
  FULCRUM_REQUIRE(pages <= options_.kv_pages,
                  "prompt ({} tokens) + max_tokens ({}) needs {} KV pages of {} tokens; the pool has {}",
                  params.prompt.size(), params.max_tokens, pages, options_.page_size, options_.kv_pages);

  std::lock_guard lock(mutex_);
  if (!accepting_) throw ApiError(503, "unavailable", "the server is shutting down");
  const int64_t id = next_id_++;
  auto handle = std::make_shared<RequestHandle>(id, static_cast<int>(params.prompt.size()));
  handle->set_wake([this] { wake(); });
  uint64_t seed_state = static_cast<uint64_t>(id);
  const uint64_t seed = params.seed.value_or(model::splitmix64(seed_state));
  auto seq = std::make_unique<Sequence>();
  seq->handle = handle;
  seq->params = std::move(params);
  seq->rng = model::Rng(seed);
  seq->pages = pages;
  waiting_.push_back(std::move(seq));
  work_pending_ = true;
  cv_.notify_one();
  return handle;
}

void Scheduler::wake() {
  std::lock_guard lock(mutex_);
  work_pending_ = true;
  cv_.notify_one();
}

void Scheduler::finish(Sequence& seq, FinishReason reason, std::optional<size_t> stop_text_length) {
  seq.handle->finish(reason, stop_text_length);
  if (metrics_) metrics_->on_request_finished(finish_reason_name(reason));
}

void Scheduler::drop_cancelled() {
  std::lock_guard lock(mutex_);
  const auto cancelled = [&](const std::unique_ptr<Sequence>& s) { return cancel_all_ || s->handle->cancel_requested(); };
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (!cancelled(*it)) {
      ++it;
      continue;
    }
    finish(**it, FinishReason::kCancelled);
    it = waiting_.erase(it);
  }
  for (auto it = running_.begin(); it != running_.end();) {
    if (!cancelled(*it)) {
      ++it;
      continue;
    }
    release_kv(**it);
    finish(**it, FinishReason::kCancelled);
    it = running_.erase(it);
  }
  cancel_all_ = false;
  num_running_ = static_cast<int64_t>(running_.size());
}

std::span<const int32_t> Scheduler::Sequence::prefill_tokens() const {
  return resumed.empty() ? std::span<const int32_t>(params.prompt) : std::span<const int32_t>(resumed);
}

std::span<const int32_t> Scheduler::Sequence::match_prompt() const {
  const std::span<const int32_t> tokens = prefill_tokens();
  return wants_prompt_rows(params) && generated.empty() ? tokens.first(1) : tokens;  // one token matches no page
}

int Scheduler::pick_group(const Sequence& seq) const {
  int best = -1;
  PrefixCache::Probe best_probe;
  for (int g = 0; g < static_cast<int>(caches_.size()); ++g) {
    const PrefixCache::Probe p = caches_[static_cast<size_t>(g)]->probe(seq.match_prompt(), seq.pages);
    if (!p.fits) continue;
    if (best < 0 || p.num_cached_tokens > best_probe.num_cached_tokens ||
        (p.num_cached_tokens == best_probe.num_cached_tokens &&
         group_running_[static_cast<size_t>(g)] < group_running_[static_cast<size_t>(best)])) {
      best = g;
      best_probe = p;
    }
  }
  // Blocked: its next prompt page is being prefilled in that group; it is ready within that prefill.
  return best >= 0 && !best_probe.blocked ? best : -1;
}

void Scheduler::admit() {
  std::lock_guard lock(mutex_);
  while (!waiting_.empty() && static_cast<int>(running_.size()) < options_.max_running_requests) {
    const int group = pick_group(*waiting_.front());
    if (group < 0) break;
    std::unique_ptr<Sequence> seq = std::move(waiting_.front());
    waiting_.pop_front();
    PrefixCache& cache = *caches_[static_cast<size_t>(group)];
    seq->lease = cache.acquire(seq->match_prompt(), seq->pages);
    const int64_t cached = seq->lease.num_cached_tokens;
    try {
      executor_.allocate_on_pages(seq->handle->id(),
                                  {.capacity = static_cast<int64_t>(seq->params.prompt.size()) + seq->params.max_tokens,
                                   .dp_group = group,
                                   .page_ids = seq->lease.page_ids,
                                   .num_cached_tokens = cached,
                                   .copy_source_page = seq->lease.copy_source_page});
    } catch (const ExecutorFailure&) {  // no rank can run anything: Scheduler::run ends every request and stops
      cache.release(seq->lease, {}, 0);
      finish(*seq, FinishReason::kError);
      throw;
    } catch (const WorldReformed&) {  // its lease goes with the cache; it is admitted again after the others
      seq->lease = PrefixCache::Lease{};
      waiting_.push_front(std::move(seq));
      run_again_after_reform();
      break;
    } catch (const std::exception& e) {
      cache.release(seq->lease, {}, 0);
      fmt::print(stderr, "fulcrum serve: request {} could not get its KV cache: {}\n", seq->handle->id(), e.what());
      finish(*seq, FinishReason::kError);
      continue;
    }
    seq->dp_group = group;
    seq->prefilled = seq->kv_written = cached;
    ++group_running_[static_cast<size_t>(group)];
    hit_tokens_ += cached;
    admitted_prompt_tokens_ += static_cast<int64_t>(seq->prefill_tokens().size());
    if (metrics_) metrics_->add_prompt_tokens(cached);  // the rest is counted as it is prefilled
    running_.push_back(std::move(seq));
  }
  num_running_ = static_cast<int64_t>(running_.size());
}

void Scheduler::release_kv(Sequence& seq) {
  executor_.release(seq.handle->id());
  std::vector<int32_t> tokens = seq.params.prompt;  // its positions: prompt, then what it generated
  tokens.insert(tokens.end(), seq.generated.begin(), seq.generated.end());
  caches_[static_cast<size_t>(seq.dp_group)]->release(seq.lease, tokens, seq.kv_written);
  --group_running_[static_cast<size_t>(seq.dp_group)];
}

FlushResult Scheduler::flush_cache() {
  std::lock_guard lock(mutex_);
  FlushResult out;
  for (const auto& cache : caches_) {
    out.flushed_pages += cache->flush();
    out.in_use_pages += cache->num_cached_pages();
  }
  return out;
}

void Scheduler::run_again_after_reform() {
  PrefixCache::Dropped dropped;
  for (const auto& cache : caches_) {
    const PrefixCache::Dropped d = cache->drop_all();
    dropped.num_prefixes += d.num_prefixes;
    dropped.num_pages += d.num_pages;
  }
  dropped_cache_pages_ += dropped.num_pages;
  if (options_.prefix_cache) {
    fmt::print(stderr, "fulcrum serve: elastic: dropped the prefix cache with the old KV pools: {} cached prefix(es), "
               "{} page(s) over {} group(s)\n", dropped.num_prefixes, dropped.num_pages, caches_.size());
  }
  int64_t tokens = 0;
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {  // ahead of every request not yet admitted
    Sequence& seq = **it;
    executor_.release(seq.handle->id());  // a no-op: the executor dropped it
    seq.resumed = seq.params.prompt;
    seq.resumed.insert(seq.resumed.end(), seq.generated.begin(), seq.generated.end());
    tokens += static_cast<int64_t>(seq.resumed.size());
    seq.lease = PrefixCache::Lease{};  // void: its cache was dropped
    seq.dp_group = -1;
    seq.prefilled = seq.kv_written = 0;
    if (seq.generated.empty()) seq.prompt_logprobs.clear();  // gathered again
    waiting_.push_front(std::move(*it));
  }
  fmt::print(stderr, "fulcrum serve: elastic: re-prefilling {} request(s) ({} tokens: prompt and generated so far), "
             "queued again ahead of the rest\n", running_.size(), tokens);
  std::fflush(stderr);
  if (metrics_) metrics_->add_reprefilled_requests(static_cast<int64_t>(running_.size()));
  running_.clear();
  num_running_ = 0;
  std::fill(group_running_.begin(), group_running_.end(), 0);
  work_pending_ = true;
}

std::optional<Scheduler::Ending> Scheduler::after_token(Sequence& seq, int32_t token, model::TokenLogprob logprob) {
  const RequestParams& p = seq.params;
  if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end()) {
    return Ending{&seq, FinishReason::kStop};
  }
  seq.generated.push_back(token);
  if (metrics_) metrics_->add_generation_tokens(1);
  seq.handle->push_token(token, p.logprobs ? std::optional(std::move(logprob)) : std::nullopt);
  if (!p.stop.empty()) {
    const std::string text = detokenizer_(seq.generated);
    size_t first = std::string::npos;
    for (const std::string& s : p.stop) first = std::min(first, text.find(s));
    if (first != std::string::npos) return Ending{&seq, FinishReason::kStop, first};
  }
  if (static_cast<int>(seq.generated.size()) >= p.max_tokens) return Ending{&seq, FinishReason::kLength};
  return std::nullopt;
}

bool Scheduler::step() {
  const auto entered = std::chrono::steady_clock::now();
  drop_cancelled();
  admit();

  // Batch: decodes first (one token each), then prompt chunks within the prefill budget. An entry samples
  // when its prompt is complete after it: every decode, and the chunk that ends a prompt.
  StepRecord record;
  std::vector<model::StepSequence> batch;
  std::vector<Sequence*> members;
  std::vector<model::Rng> rngs_before;  // members' generators before this step's draws (WorldReformed: again)
  const auto add = [&](Sequence& seq, std::span<const int32_t> tokens, bool prefill) {
    model::StepSequence& in = batch.emplace_back();
    in.id = seq.handle->id();
    in.token_ids = tokens;
    in.sample = !prefill || seq.prefilled + static_cast<int64_t>(tokens.size()) ==
                                static_cast<int64_t>(seq.prefill_tokens().size());
    in.sampling = seq.params.sampling;
    rngs_before.push_back(seq.rng);
    // The draws model::sample_token makes: one per sampled token, none when greedy.
    if (in.sample && in.sampling.temperature > 0.0f) in.uniform = seq.rng.uniform();
    in.want_logprob = seq.params.logprobs;
    in.top_logprobs = seq.params.top_logprobs;
    if (prefill && seq.params.prompt_logprobs_from >= 0 && seq.generated.empty()) {
      // Row r of the chunk at prefilled predicts prompt position prefilled + r + 1: the targets are the
      // positions in [max(from, prefilled + 1), min(prefilled + n, prompt - 1)].
      const int64_t first = std::max(seq.params.prompt_logprobs_from, seq.prefilled + 1);
      const int64_t last = std::min(seq.prefilled + static_cast<int64_t>(tokens.size()),
                                    static_cast<int64_t>(seq.params.prompt.size()) - 1);
      if (first <= last) in.prompt_targets = std::span<const int32_t>(seq.params.prompt).subspan(first, last - first + 1);
    }
    members.push_back(&seq);
    record.entries.push_back({in.id, static_cast<int>(tokens.size()), prefill});
  };
  for (const auto& seq : running_) {
    if (seq->prefilled < static_cast<int64_t>(seq->prefill_tokens().size())) continue;
    add(*seq, std::span<const int32_t>(&seq->generated.back(), 1), false);
  }
  int budget = options_.max_prefill_tokens;
  for (const auto& seq : running_) {
    const int64_t left = static_cast<int64_t>(seq->prefill_tokens().size()) - seq->prefilled;
    if (left == 0 || budget == 0) continue;
    const int n = static_cast<int>(std::min<int64_t>(left, budget));
    budget -= n;
    add(*seq, seq->prefill_tokens().subspan(seq->prefilled, n), true);
    record.prefill_tokens += n;
  }
  last_step_ = record;
  if (batch.empty()) return false;

  const auto start = std::chrono::steady_clock::now();
  model::StepOutput out;
  try {
    out = executor_.step(batch);
    FULCRUM_CHECK(out.tokens.size() == batch.size() && out.errors.size() == batch.size(),
                  "the executor returned {} tokens and {} errors for {} entries", out.tokens.size(),
                  out.errors.size(), batch.size());
  } catch (const ExecutorFailure& e) {
    fmt::print(stderr, "fulcrum serve: {}; ending every request\n", e.what());
    fail_all();
    throw;
  } catch (const WorldReformed&) {
    for (size_t i = 0; i < members.size(); ++i) members[i]->rng = rngs_before[i];
    std::lock_guard lock(mutex_);
    run_again_after_reform();
    return true;
  } catch (const std::exception& e) {
    fmt::print(stderr, "fulcrum serve: step failed, ending its {} request(s): {}\n", members.size(), e.what());
    std::vector<Ending> failed;
    for (Sequence* seq : members) failed.push_back({seq, FinishReason::kError});
    retire(failed);
    return true;
  }
  int64_t batch_tokens = 0;
  for (const model::StepSequence& in : batch) batch_tokens += static_cast<int64_t>(in.token_ids.size());
  const auto stepped = std::chrono::steady_clock::now();
  if (metrics_) metrics_->observe_step(std::chrono::duration<double>(stepped - start).count(), batch_tokens);

  {
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < members.size(); ++i) {  // the pages these positions complete are ready to share
      Sequence& seq = *members[i];
      seq.kv_written += record.entries[i].num_tokens;
      caches_[static_cast<size_t>(seq.dp_group)]->on_written(seq.lease, seq.kv_written);
    }
  }
  std::vector<Ending> finished;
  const int vocab = executor_.vocab_size();
  for (size_t i = 0; i < members.size(); ++i) {
    Sequence& seq = *members[i];
    if (record.entries[i].prefill) {
      seq.prefilled += record.entries[i].num_tokens;
      if (metrics_) metrics_->add_prompt_tokens(record.entries[i].num_tokens);
    }
    const auto fail = [&](const std::string& reason) {  // this request ends, the others go on
      fmt::print(stderr, "fulcrum serve: request {} failed: {}\n", seq.handle->id(), reason);
      finished.push_back({&seq, FinishReason::kError});
    };
    if (!out.errors[i].empty()) {  // e.g. non-finite logits
      fail(out.errors[i]);
      continue;
    }
    if (!batch[i].prompt_targets.empty()) {
      if (i >= out.prompt_logprobs.size() || out.prompt_logprobs[i].size() != batch[i].prompt_targets.size()) {
        fail(fmt::format("the executor returned no logprobs for {} prompt tokens", batch[i].prompt_targets.size()));
        continue;
      }
      for (model::TokenLogprob& lp : out.prompt_logprobs[i]) seq.prompt_logprobs.push_back(std::move(lp));
    }
    if (!batch[i].sample) continue;
    if (seq.params.prompt_logprobs_from >= 0 && seq.generated.empty()) {
      seq.handle->set_prompt_logprobs(std::move(seq.prompt_logprobs));  // before the first token is seen
    }
    const int32_t token = out.tokens[i];
    if (token < 0 || token >= vocab) {
      fail(fmt::format("the executor sampled token {}, outside [0, {})", token, vocab));
      continue;
    }
    try {
      model::TokenLogprob logprob;
      if (seq.params.logprobs) {
        logprob = i < out.top_logprobs.size() ? std::move(out.top_logprobs[i]) : model::TokenLogprob{};
        logprob.logprob = out.logprobs[i];
      }
      if (const std::optional<Ending> end = after_token(seq, token, std::move(logprob))) finished.push_back(*end);
    } catch (const std::exception& e) {
      fail(e.what());
    }
  }
  retire(finished);
  if (metrics_) {
    const auto now = std::chrono::steady_clock::now();
    metrics_->add_scheduler_host_seconds(std::chrono::duration<double>((start - entered) + (now - stepped)).count());
  }
  return true;
}

// Under the lock that gauges() takes, so a client that has seen its request end finds it gone from the
// server's gauges (before, the handle finished first and /metrics right after could still count its pages).
void Scheduler::retire(const std::vector<Ending>& done) {
  if (done.empty()) return;
  std::lock_guard lock(mutex_);
  for (const Ending& end : done) release_kv(*end.seq);
  for (const Ending& end : done) finish(*end.seq, end.reason, end.stop_text_length);
  std::erase_if(running_, [&](const std::unique_ptr<Sequence>& s) {
    return std::any_of(done.begin(), done.end(), [&](const Ending& end) { return end.seq == s.get(); });
  });
  num_running_ = static_cast<int64_t>(running_.size());
}

void Scheduler::fail_all() {
  std::lock_guard lock(mutex_);
  accepting_ = false;
  for (auto& seq : waiting_) finish(*seq, FinishReason::kError);
  for (auto& seq : running_) {
    release_kv(*seq);
    finish(*seq, FinishReason::kError);
  }
  waiting_.clear();
  running_.clear();
  num_running_ = 0;
}

void Scheduler::run() {
  for (;;) {
    bool did = false;
    try {
      did = step();
    } catch (...) {
      fail_all();  // no handler may wait for a request this loop will never finish
      throw;
    }
    std::unique_lock lock(mutex_);
    if (stop_ && waiting_.empty() && running_.empty()) break;
    if (!did) {
      cv_.wait(lock, [&] { return work_pending_ || stop_; });
      work_pending_ = false;
    }
  }
}

void Scheduler::stop_accepting() {
  std::lock_guard lock(mutex_);
  accepting_ = false;
}

void Scheduler::cancel_all() {
  std::lock_guard lock(mutex_);
  cancel_all_ = true;
  work_pending_ = true;
  cv_.notify_one();
}

void Scheduler::stop() {
  std::lock_guard lock(mutex_);
  accepting_ = false;
  stop_ = true;
  cancel_all_ = true;
  cv_.notify_one();
}

QueueGauges Scheduler::gauges() const {
  std::lock_guard lock(mutex_);
  QueueGauges g{num_running_, static_cast<int64_t>(waiting_.size())};
  for (const auto& cache : caches_) {
    g.kv_pages_used += cache->num_used_pages();
    g.kv_pages_total += cache->num_pages();
    g.prefix_cache_pages += cache->num_cached_pages();
    g.prefix_cache_evicted_pages += cache->num_evicted_pages();
  }
  g.prefix_cache_enabled = options_.prefix_cache;
  g.prefix_cache_hit_tokens = hit_tokens_;
  g.prefix_cache_dropped_pages = dropped_cache_pages_;
  g.admitted_prompt_tokens = admitted_prompt_tokens_;
  return g;
}

bool Scheduler::idle() const {
  std::lock_guard lock(mutex_);
  return waiting_.empty() && num_running_ == 0;
}

}  // namespace fulcrum::server
