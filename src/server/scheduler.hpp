#pragma once
// Continuous batching over a StepExecutor. Each step():
//   1. drops cancelled requests (waiting or running) and frees their KV pages;
//   2. admits waiting requests in arrival order while the running batch has room (max_running_requests)
//      and the KV pool has the pages a request needs for its whole life, ceil((prompt + max_tokens) /
//      page_size), less those it shares with the prefix cache; the first request that does not fit waits,
//      and so does everything behind it (no overtaking, no starvation). Nothing is dropped for lack of room;
//      a request whose next prompt page another running request is still prefilling waits for it too.
//      Each attention-DP group has its own pool and prefix cache (prefix_cache.hpp, one page table per
//      sequence, given to the executor by allocate_on_pages); a request joins the group that fits it with
//      the longest cached prefix, then the one with the fewest running requests, then the lowest. A
//      request starts its prefill after its cached prefix;
//   3. builds the batch: every running request past its prompt contributes its last sampled token; the
//      rest get prompt chunks, in admission order, within max_prefill_tokens per step (chunked prefill);
//      A request that asks for prompt logprobs gets, in each chunk, the prompt targets its rows predict
//      (StepSequence::prompt_targets) and shares no cached prefix;
//   4. runs the executor, which samples a token for each entry that completes its prompt or decodes (the
//      scheduler draws the entry's uniform from the request's Rng when its temperature is > 0: the draws
//      model::sample_token would make), checks stop token ids, stop strings and max_tokens, and frees the
//      pages of finished requests. An entry the executor could not sample ends its request with "error".
// Requests join and leave the batch at every step. A request whose pages exceed the whole pool, or whose
// length exceeds the model's, is refused at submit() with an ApiError (400). A step that fails ends its
// batch's requests with reason "error" and the scheduler goes on; an ExecutorFailure (the executor can run
// no further step) ends every request, refuses new ones, and step() / run() rethrow it.
// A WorldReformed (elastic EP rebuilt every KV pool empty) fails nothing: every group's prefix cache is
// dropped whole (index and leases: its pages are gone), and every running request goes back to the head of
// the queue, in admission order, to be admitted again and prefill its prompt and the tokens it generated so
// far (sharing prefixes again as the cache refills); its next token is sampled from that prefill's last row,
// as its decode would have, with the uniform the failed step drew.
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "model/rng.hpp"
#include "server/metrics.hpp"
#include "server/prefix_cache.hpp"
#include "server/request.hpp"
#include "server/step_executor.hpp"

namespace fulcrum::server {

struct SchedulerOptions {
  int max_running_requests = 32;
  int64_t kv_pages = 512;       // KV pages of each attention-DP group's pool
  int page_size = 16;           // tokens per KV page
  int max_prefill_tokens = 512; // prompt tokens per step, over all requests
  bool prefix_cache = true;     // share KV pages of common prompt prefixes (--disable-radix-cache: off)
};

// What flush_cache() did.
struct FlushResult {
  int64_t flushed_pages = 0;  // cached pages no request held: now free
  int64_t in_use_pages = 0;   // cached pages running requests hold: indexed still, evictable once they end
};

// Text of generated ids, for stop strings; empty when the server has no tokenizer.
using Detokenizer = std::function<std::string(std::span<const int32_t>)>;

// One step's batch, for tests and logs.
struct StepRecord {
  struct Entry {
    SequenceId id = 0;
    int num_tokens = 0;
    bool prefill = false;
  };
  std::vector<Entry> entries;
  int prefill_tokens = 0;
};

class Scheduler {
 public:
  Scheduler(StepExecutor& executor, SchedulerOptions options, Detokenizer detokenizer = {},
            ServerMetrics* metrics = nullptr);

  // Queues a request; throws ApiError 400 when it can never run, 503 once shutdown began. Thread-safe.
  std::shared_ptr<RequestHandle> submit(RequestParams params);

  // One scheduling step (see above); false when there was nothing to run. Call from one thread.
  bool step();
  // Runs steps until stop(); sleeps while idle.
  void run();
  // Refuse new requests from now on (503); queued and running ones continue.
  void stop_accepting();
  // Cancels every waiting and running request (each finishes with reason "cancelled").
  void cancel_all();
  // Makes run() return after its current step; pending requests are cancelled first.
  void stop();

  // Empties the prefix cache of every group (pages in use stay). Thread-safe.
  FlushResult flush_cache();

  QueueGauges gauges() const;
  bool idle() const;
  const StepRecord& last_step() const { return last_step_; }
  const SchedulerOptions& options() const { return options_; }

 private:
  struct Sequence {
    std::shared_ptr<RequestHandle> handle;
    RequestParams params;
    model::Rng rng;
    int64_t pages = 0;
    int64_t prefilled = 0;  // prompt tokens already in the KV cache
    std::vector<int32_t> generated;
    int dp_group = -1;        // once admitted
    PrefixCache::Lease lease;  // its pages, once admitted
    int64_t kv_written = 0;   // positions in its KV cache (cached prefix, prefilled, decoded)
    std::vector<model::TokenLogprob> prompt_logprobs;  // gathered over its prefill chunks (when asked)
    // After a WorldReformed: its prompt, then what it had generated then. Empty: the prompt alone.
    std::vector<int32_t> resumed;
    // The tokens it prefills before it decodes: resumed, or the prompt.
    std::span<const int32_t> prefill_tokens() const;
    // What the prefix cache matches: none of it for a request that wants prompt logprobs still to come (its
    // every prompt row must run).
    std::span<const int32_t> match_prompt() const;
  };

  int64_t pages_for(const RequestParams& params) const;
  int pick_group(const Sequence& seq) const;  // -1: it waits; under mutex_
  void release_kv(Sequence& seq);             // executor and prefix cache; under mutex_
  void drop_cancelled();
  void admit();
  void finish(Sequence& seq, FinishReason reason, std::optional<size_t> stop_text_length = std::nullopt);
  struct Ending {  // a running sequence that ends this step, and how
    Sequence* seq = nullptr;
    FinishReason reason = FinishReason::kNone;
    std::optional<size_t> stop_text_length;
  };
  // Set when the sequence ends; `logprob` goes to the handle when the request asked.
  std::optional<Ending> after_token(Sequence& seq, int32_t token, model::TokenLogprob logprob);
  void retire(const std::vector<Ending>& done);  // releases KV and pages, then finishes the handles, leaves the batch
  void fail_all();  // every waiting and running request ends with "error"; no new ones
  // After WorldReformed, under mutex_: the prefix caches dropped, every running request queued again.
  void run_again_after_reform();
  void wake();

  StepExecutor& executor_;
  const SchedulerOptions options_;
  const Detokenizer detokenizer_;
  ServerMetrics* metrics_;

  mutable std::mutex mutex_;  // guards waiting_, counts, flags below
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  int64_t num_running_ = 0;   // mirrors running_.size() for gauges()
  std::vector<std::unique_ptr<PrefixCache>> caches_;  // [executor's KV groups]
  std::vector<int64_t> group_running_;                // [KV groups] running requests in each
  int64_t hit_tokens_ = 0, admitted_prompt_tokens_ = 0;
  int64_t dropped_cache_pages_ = 0;  // by run_again_after_reform, since start
  int64_t next_id_ = 1;
  bool accepting_ = true;
  bool stop_ = false;
  bool cancel_all_ = false;
  bool work_pending_ = false;

  std::vector<std::unique_ptr<Sequence>> running_;  // admission order; loop thread only
  StepRecord last_step_;
};

}  // namespace fulcrum::server
