#include "server/request.hpp"

namespace fulcrum::server {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
    case FinishReason::kNone: break;
  }
  return "none";
}

RequestUpdate RequestHandle::wait(size_t seen, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  cv_.wait_for(lock, timeout, [&] { return tokens_.size() > seen || reason_ != FinishReason::kNone; });
  RequestUpdate update;
  if (tokens_.size() > seen) update.new_tokens.assign(tokens_.begin() + static_cast<ptrdiff_t>(seen), tokens_.end());
  if (logprobs_.size() > seen) update.new_logprobs.assign(logprobs_.begin() + static_cast<ptrdiff_t>(seen), logprobs_.end());
  update.finished = reason_ != FinishReason::kNone;
  update.reason = reason_;
  return update;
}

std::vector<int32_t> RequestHandle::wait_finished() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return reason_ != FinishReason::kNone; });
  return tokens_;
}

std::vector<model::TokenLogprob> RequestHandle::logprobs() const {
  std::lock_guard lock(mutex_);
  return logprobs_;
}

std::vector<model::TokenLogprob> RequestHandle::prompt_logprobs() const {
  std::lock_guard lock(mutex_);
  return prompt_logprobs_;
}

void RequestHandle::set_prompt_logprobs(std::vector<model::TokenLogprob> logprobs) {
  std::lock_guard lock(mutex_);
  prompt_logprobs_ = std::move(logprobs);
}

FinishReason RequestHandle::finish_reason() const {
  std::lock_guard lock(mutex_);
  return reason_;
}

std::optional<size_t> RequestHandle::stop_text_length() const {
  std::lock_guard lock(mutex_);
  return stop_text_length_;
}

void RequestHandle::cancel() {
  std::function<void()> wake;
  {
    std::lock_guard lock(mutex_);
    if (cancel_ || reason_ != FinishReason::kNone) return;
    cancel_ = true;
    wake = wake_;
  }
  if (wake) wake();
}

bool RequestHandle::cancel_requested() const {
  std::lock_guard lock(mutex_);
  return cancel_;
}

void RequestHandle::push_token(int32_t token, std::optional<model::TokenLogprob> logprob) {
  std::function<void()> on_progress;
  {
    std::lock_guard lock(mutex_);
    tokens_.push_back(token);
    if (logprob) logprobs_.push_back(std::move(*logprob));
    on_progress = on_progress_;
  }
  cv_.notify_all();
  if (on_progress) on_progress();
}

void RequestHandle::finish(FinishReason reason, std::optional<size_t> stop_text_length) {
  std::function<void()> on_progress;
  {
    std::lock_guard lock(mutex_);
    if (reason_ != FinishReason::kNone) return;
    reason_ = reason;
    stop_text_length_ = stop_text_length;
    on_progress = on_progress_;
  }
  cv_.notify_all();
  if (on_progress) on_progress();
}

void RequestHandle::set_wake(std::function<void()> wake) {
  std::lock_guard lock(mutex_);
  wake_ = std::move(wake);
}

}  // namespace fulcrum::server

namespace fulcrum::server {

void RequestHandle::set_on_progress(std::function<void()> on_progress) {
  std::lock_guard lock(mutex_);
  on_progress_ = std::move(on_progress);
}

}  // namespace fulcrum::server
