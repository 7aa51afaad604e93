#pragma once
// Response bodies: OpenAI completion / chat completion objects and their SSE chunks, SGLang's /generate
// object, and the error body. One ResponseWriter follows one request from submit to its last byte.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "server/protocol.hpp"
#include "server/request.hpp"
#include "server/text_stream.hpp"

namespace fulcrum::server {

enum class Endpoint { kCompletion, kChat, kGenerate };

nlohmann::json error_body(const std::string& message, const std::string& type);

// Non-streamed bodies of one request's choices (each from ResponseWriter::complete) as one response: OpenAI's
// object with every choice, `index` set, usage summed (a prompt's tokens counted once for its n choices);
// /generate's object, or with `batched` the list of them.
nlohmann::json merge_choices(Endpoint endpoint, std::vector<nlohmann::json> bodies, int n, bool batched);

class ResponseWriter {
 public:
  // `prefill_only` (/generate max_new_tokens 0, completions max_tokens 0): the body reports no output token (the
  // request ran its prompt and the one token that ends a prefill, which is dropped). `format` says which
  // logprobs the body carries (the handle has them when the request asked); `prompt` is the request's prompt
  // (echo, input_token_logprobs).
  ResponseWriter(Endpoint endpoint, std::shared_ptr<RequestHandle> handle, const tokenizer::Tokenizer* tokenizer,
                 std::vector<std::string> stop, std::string model_name, bool include_usage, bool prefill_only = false,
                 LogprobFormat format = {}, std::vector<int32_t> prompt = {});

  // Waits for the request to finish; the whole JSON body. `client_gone` (optional) is asked every
  // `poll_interval` and on every new token; once it says yes the request is cancelled (its KV pages free
  // at the scheduler's next step) and the body says "cancelled".
  nlohmann::json complete(const std::function<bool()>& client_gone = {},
                          std::chrono::milliseconds poll_interval = std::chrono::milliseconds(100));

  // Streaming: waits up to `timeout` for progress and returns the SSE bytes to send now ("" when none;
  // then a keep-alive comment is due). After the last event (finish, usage, [DONE]) done() is true.
  std::string next_events(std::chrono::milliseconds timeout);
  bool done() const { return done_; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }  // output tokens seen so far
  RequestHandle& handle() { return *handle_; }

 private:
  nlohmann::json usage() const;
  std::string chunk(const std::string& text, std::span<const int32_t> ids, const char* finish_reason,
                    const model::TokenLogprob* logprob = nullptr);
  std::string generate_event(const char* finish_reason) const;
  nlohmann::json generate_meta(nlohmann::json finish_reason) const;
  std::string token_text(int32_t id) const;
  // OpenAI completions' logprobs object over (token, logprob or null) positions, text offsets from `offset`.
  nlohmann::json completion_logprobs(std::span<const int32_t> ids, std::span<const model::TokenLogprob* const> lps,
                                     size_t& offset) const;
  nlohmann::json chat_logprob(int32_t id, const model::TokenLogprob& lp) const;
  nlohmann::json sglang_entry(float logprob, bool known, int32_t id) const;  // [logprob or null, id, text or null]
  nlohmann::json sglang_top(const model::TokenLogprob& lp) const;

  const Endpoint endpoint_;
  std::shared_ptr<RequestHandle> handle_;
  TextStream text_;
  const std::string model_name_;
  const bool include_usage_;
  const bool prefill_only_;
  const LogprobFormat format_;
  const std::vector<int32_t> prompt_;
  const tokenizer::Tokenizer* tokenizer_;
  const std::string id_;
  const int64_t created_;
  std::vector<int32_t> tokens_;  // seen so far
  std::vector<model::TokenLogprob> logprobs_;  // [tokens_] when the request asked
  size_t text_offset_ = 0;       // streaming completions: text_offset of the next token
  bool sent_role_ = false;
  bool done_ = false;
};

}  // namespace fulcrum::server
