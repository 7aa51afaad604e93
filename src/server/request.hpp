#pragma once
// One generation request as the scheduler sees it (token ids in, token ids out) and the handle through
// which the HTTP side follows it: new tokens as they are sampled, the finish reason, cancellation.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "model/sampling.hpp"
#include "model/step_model.hpp"

namespace fulcrum::server {

struct RequestParams {
  std::vector<int32_t> prompt;
  model::SamplingParams sampling;
  std::optional<uint64_t> seed;  // none: a seed derived from the request id
  int max_tokens = 16;           // tokens to generate at most (>= 1)
  std::vector<int32_t> stop_token_ids;  // ends generation; the stop token is not part of the output
  std::vector<std::string> stop;        // stop strings (need a tokenizer); the output text ends before them
  // Logprobs (model::TokenLogprob: log-softmax of the raw logits, temperature 1, before top-k / top-p).
  bool logprobs = false;           // each generated token's logprob
  int top_logprobs = 0;            // [0, model::kMaxTopLogprobs]: with each reported logprob, the N most likely
  int64_t prompt_logprobs_from = -1;  // -1: none; else the logprob of every prompt position >= this (>= 1: the
                                      // first token has none). Such a request shares no cached prefix.
};

enum class FinishReason { kNone, kStop, kLength, kCancelled, kError };
const char* finish_reason_name(FinishReason reason);

// What a reader has not seen yet, and whether the request is over.
struct RequestUpdate {
  std::vector<int32_t> new_tokens;
  std::vector<model::TokenLogprob> new_logprobs;  // one per new token when the request asked for logprobs
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
};

// Shared by the scheduler (writer) and one HTTP handler (reader). Thread-safe.
class RequestHandle {
 public:

  RequestHandle(int64_t id, int prompt_tokens) : id_(id), prompt_tokens_(prompt_tokens) {}

  int64_t id() const { return id_; }
  int prompt_tokens() const { return prompt_tokens_; }

  // Blocks until there are tokens beyond the first `seen`, the request finished, or `timeout` passed.
  RequestUpdate wait(size_t seen, std::chrono::milliseconds timeout);
  // Blocks until the request finished; returns every token.
  std::vector<int32_t> wait_finished();
  // Every generated token's logprob so far (empty unless the request asked), and the prompt's (positions
  // prompt_logprobs_from.., set before the first token arrives; empty unless asked).
  std::vector<model::TokenLogprob> logprobs() const;
  std::vector<model::TokenLogprob> prompt_logprobs() const;
  FinishReason finish_reason() const;
  // Byte length of the output text when a stop string ended it (the text ends before the stop string).
  std::optional<size_t> stop_text_length() const;

  // Asks the scheduler to drop the request at its next step (client gone, or explicit). Idempotent.
  void cancel();
  bool cancel_requested() const;

  // Scheduler side.
  void push_token(int32_t token, std::optional<model::TokenLogprob> logprob = std::nullopt);
  void set_prompt_logprobs(std::vector<model::TokenLogprob> logprobs);
  void finish(FinishReason reason, std::optional<size_t> stop_text_length = std::nullopt);
  void set_wake(std::function<void()> wake);
  // Reader side: called (on the scheduler's thread, outside the handle's lock) after every new token and the
  // finish, so an event loop learns of progress without a thread blocked in wait().
  void set_on_progress(std::function<void()> on_progress);

 private:
  const int64_t id_;
  const int prompt_tokens_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<int32_t> tokens_;
  std::vector<model::TokenLogprob> logprobs_;         // [tokens_] or empty
  std::vector<model::TokenLogprob> prompt_logprobs_;
  FinishReason reason_ = FinishReason::kNone;
  std::optional<size_t> stop_text_length_;
  bool cancel_ = false;
  std::function<void()> wake_;
  std::function<void()> on_progress_;
};

}  // namespace fulcrum::server
