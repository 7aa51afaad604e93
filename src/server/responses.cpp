#include "server/responses.hpp"

#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

namespace fulcrum::server {
namespace {

using nlohmann::json;

std::string sse(const json& event) { return "data: " + event.dump() + "\n\n"; }

json finish_json(const char* reason) { return reason ? json(reason) : json(nullptr); }

// A logprob as JSON: the float's shortest decimal (not its double widening), null when not finite.
json logprob_json(float v) {
  if (!std::isfinite(v)) return nullptr;
  return std::strtod(fmt::format("{}", v).c_str(), nullptr);
}

}  // namespace

json error_body(const std::string& message, const std::string& type) {
  return {{"error", {{"message", message}, {"type", type}}}};
}

json merge_choices(Endpoint endpoint, std::vector<json> bodies, int n, bool batched) {
  if (endpoint == Endpoint::kGenerate) return batched ? json(std::move(bodies)) : std::move(bodies.at(0));
  json choices = json::array();
  int64_t prompt_tokens = 0, completion_tokens = 0;
  for (size_t i = 0; i < bodies.size(); ++i) {
    json choice = bodies[i]["choices"][0];
    choice["index"] = i;
    choices.push_back(std::move(choice));
    if (i % static_cast<size_t>(n) == 0) prompt_tokens += bodies[i]["usage"]["prompt_tokens"].get<int64_t>();
    completion_tokens += bodies[i]["usage"]["completion_tokens"].get<int64_t>();
  }
  json out = std::move(bodies.at(0));
  out["choices"] = std::move(choices);
  out["usage"] = {{"prompt_tokens", prompt_tokens}, {"completion_tokens", completion_tokens},
                  {"total_tokens", prompt_tokens + completion_tokens}};
  return out;
}

ResponseWriter::ResponseWriter(Endpoint endpoint, std::shared_ptr<RequestHandle> handle,
                               const tokenizer::Tokenizer* tokenizer, std::vector<std::string> stop,
                               std::string model_name, bool include_usage, bool prefill_only, LogprobFormat format,
                               std::vector<int32_t> prompt)
    : endpoint_(endpoint), handle_(std::move(handle)), text_(tokenizer, std::move(stop)),
      model_name_(std::move(model_name)), include_usage_(include_usage), prefill_only_(prefill_only),
      format_(format), prompt_(std::move(prompt)), tokenizer_(tokenizer),
      id_(fmt::format("{}-{}", endpoint == Endpoint::kChat ? "chatcmpl" : "cmpl", handle_->id())),
      created_(std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count()) {}

// A token's own text (as OpenAI's `tokens` and SGLang's return_text_in_logprobs give it); "token_id:N" where
// there is no tokenizer or it does not know the id. Bytes that are not UTF-8 alone show as U+FFFD.
std::string ResponseWriter::token_text(int32_t id) const {
  if (tokenizer_ != nullptr && id >= 0 && id < tokenizer_->id_bound()) {
    try {
      return tokenizer_->decode({id});
    } catch (const std::exception&) {
      // an id the tokenizer has no piece for: named by its number below
    }
  }
  return fmt::format("token_id:{}", id);
}

json ResponseWriter::completion_logprobs(std::span<const int32_t> ids, std::span<const model::TokenLogprob* const> lps,
                                         size_t& offset) const {
  json tokens = json::array(), values = json::array(), tops = json::array(), offsets = json::array();
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string text = token_text(ids[i]);
    tokens.push_back(text);
    offsets.push_back(offset);
    offset += text.size();
    const model::TokenLogprob* lp = lps[i];
    if (lp == nullptr) {
      values.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    values.push_back(logprob_json(lp->logprob));
    json top = json::object();
    for (size_t k = 0; k < lp->top_ids.size(); ++k) top[token_text(lp->top_ids[k])] = logprob_json(lp->top_logprobs[k]);
    tops.push_back(std::move(top));
  }
  return {{"tokens", tokens}, {"token_logprobs", values}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json ResponseWriter::chat_logprob(int32_t id, const model::TokenLogprob& lp) const {
  const auto entry = [&](int32_t token, float value) {
    const std::string text = token_text(token);
    return json{{"token", text}, {"logprob", logprob_json(value)}, {"bytes", std::vector<uint8_t>(text.begin(), text.end())}};
  };
  json out = entry(id, lp.logprob);
  json top = json::array();
  for (size_t k = 0; k < lp.top_ids.size(); ++k) top.push_back(entry(lp.top_ids[k], lp.top_logprobs[k]));
  out["top_logprobs"] = std::move(top);
  return out;
}

json ResponseWriter::sglang_entry(float logprob, bool known, int32_t id) const {
  return json::array({known ? logprob_json(logprob) : json(nullptr), id,
                      format_.return_text_in_logprobs ? json(token_text(id)) : json(nullptr)});
}

json ResponseWriter::sglang_top(const model::TokenLogprob& lp) const {
  json out = json::array();
  for (size_t k = 0; k < lp.top_ids.size(); ++k) out.push_back(sglang_entry(lp.top_logprobs[k], true, lp.top_ids[k]));
  return out;
}

// /generate's meta_info, with SGLang's logprob fields when asked: input_token_logprobs over prompt[start..]
// (entry 0 null: its prefix is not scored), output_token_logprobs over the output, each [logprob, id, text or
// null]; with top_logprobs_num > 0, input_ and output_top_logprobs lists of those per position.
json ResponseWriter::generate_meta(json finish_reason) const {
  json meta = {{"id", id_}, {"prompt_tokens", handle_->prompt_tokens()}, {"completion_tokens", tokens_.size()},
               {"finish_reason", std::move(finish_reason)}};
  if (!format_.logprobs) return meta;
  const auto length = static_cast<int64_t>(prompt_.size());
  const int64_t start = format_.logprob_start_len < 0 ? length - 1 : format_.logprob_start_len;
  const std::vector<model::TokenLogprob> prompt_lps = handle_->prompt_logprobs();  // positions start + 1..
  json input = json::array(), input_top = json::array(), output = json::array(), output_top = json::array();
  for (int64_t pos = start; pos < length; ++pos) {
    const int64_t j = pos - start - 1;
    const bool known = j >= 0 && j < static_cast<int64_t>(prompt_lps.size());
    input.push_back(sglang_entry(known ? prompt_lps[static_cast<size_t>(j)].logprob : 0.0f, known,
                                 prompt_[static_cast<size_t>(pos)]));
    input_top.push_back(known ? sglang_top(prompt_lps[static_cast<size_t>(j)]) : json(nullptr));
  }
  for (size_t i = 0; i < tokens_.size() && i < logprobs_.size(); ++i) {
    output.push_back(sglang_entry(logprobs_[i].logprob, true, tokens_[i]));
    output_top.push_back(sglang_top(logprobs_[i]));
  }
  meta["input_token_logprobs"] = std::move(input);
  meta["output_token_logprobs"] = std::move(output);
  if (format_.top_logprobs > 0) {
    meta["input_top_logprobs"] = std::move(input_top);
    meta["output_top_logprobs"] = std::move(output_top);
  }
  return meta;
}

json ResponseWriter::usage() const {
  const int completion = static_cast<int>(tokens_.size());
  return {{"prompt_tokens", handle_->prompt_tokens()},
          {"completion_tokens", completion},
          {"total_tokens", handle_->prompt_tokens() + completion}};
}

json ResponseWriter::complete(const std::function<bool()>& client_gone, std::chrono::milliseconds poll_interval) {
  for (size_t seen = 0; client_gone;) {
    const RequestUpdate update = handle_->wait(seen, poll_interval);
    if (update.finished) break;
    seen += update.new_tokens.size();
    if (client_gone()) handle_->cancel();  // idempotent; the scheduler finishes it as "cancelled"
  }
  tokens_ = handle_->wait_finished();
  logprobs_ = handle_->logprobs();
  const FinishReason finished = handle_->finish_reason();
  const bool prompt_only = prefill_only_ && (finished == FinishReason::kStop || finished == FinishReason::kLength);
  if (prompt_only) {
    tokens_.clear();
    logprobs_.clear();
    if (endpoint_ == Endpoint::kGenerate) {
      return {{"text", ""}, {"output_ids", json::array()},
              {"meta_info", generate_meta({{"type", "length"}, {"length", 0}})}};
    }
  }
  text_.push(tokens_);
  text_.finish(handle_->stop_text_length());
  const char* reason = prompt_only ? "length" : finish_reason_name(finished);
  const std::string& text = text_.emitted();
  if (endpoint_ == Endpoint::kGenerate) {
    return {{"text", text}, {"output_ids", tokens_}, {"meta_info", generate_meta({{"type", reason}})}};
  }
  json choice = {{"index", 0}, {"finish_reason", reason}, {"token_ids", tokens_}};
  if (endpoint_ == Endpoint::kChat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
    if (format_.logprobs) {
      json content = json::array();
      for (size_t i = 0; i < tokens_.size() && i < logprobs_.size(); ++i) content.push_back(chat_logprob(tokens_[i], logprobs_[i]));
      choice["logprobs"] = {{"content", std::move(content)}};
    } else {
      choice["logprobs"] = nullptr;
    }
  } else {
    // echo: the prompt's text first (its tokens decoded), and with logprobs its positions first (the first null).
    std::string prompt_text;
    if (format_.echo && tokenizer_) {
      try {
        prompt_text = tokenizer_->decode(prompt_);
      } catch (const std::exception&) {  // an id past the tokenizer's (the model's vocabulary may be larger)
        for (const int32_t id : prompt_) prompt_text += token_text(id);
      }
    }
    choice["text"] = prompt_text + text;
    if (format_.logprobs) {
      std::vector<int32_t> ids;
      std::vector<const model::TokenLogprob*> lps;
      const std::vector<model::TokenLogprob> prompt_lps = handle_->prompt_logprobs();  // positions 1..
      if (format_.echo) {
        for (size_t pos = 0; pos < prompt_.size(); ++pos) {
          ids.push_back(prompt_[pos]);
          lps.push_back(pos >= 1 && pos - 1 < prompt_lps.size() ? &prompt_lps[pos - 1] : nullptr);
        }
      }
      for (size_t i = 0; i < tokens_.size() && i < logprobs_.size(); ++i) {
        ids.push_back(tokens_[i]);
        lps.push_back(&logprobs_[i]);
      }
      size_t offset = 0;
      choice["logprobs"] = completion_logprobs(ids, lps, offset);
    } else {
      choice["logprobs"] = nullptr;
    }
  }
  return {{"id", id_},
          {"object", endpoint_ == Endpoint::kChat ? "chat.completion" : "text_completion"},
          {"created", created_},
          {"model", model_name_},
          {"choices", json::array({choice})},
          {"usage", usage()}};
}

std::string ResponseWriter::chunk(const std::string& text, std::span<const int32_t> ids, const char* finish_reason,
                                  const model::TokenLogprob* logprob) {
  json choice = {{"index", 0}, {"finish_reason", finish_json(finish_reason)}, {"token_ids", ids}};
  const bool with_logprob = format_.logprobs && logprob != nullptr && ids.size() == 1;
  if (endpoint_ == Endpoint::kChat) {
    choice["delta"] = text.empty() && finish_reason ? json::object() : json{{"content", text}};
    choice["logprobs"] = with_logprob ? json{{"content", json::array({chat_logprob(ids[0], *logprob)})}} : json(nullptr);
  } else {
    choice["text"] = text;
    const model::TokenLogprob* lps[] = {logprob};
    choice["logprobs"] = with_logprob ? completion_logprobs(ids, lps, text_offset_) : json(nullptr);
  }
  return sse({{"id", id_},
              {"object", endpoint_ == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
              {"created", created_},
              {"model", model_name_},
              {"choices", json::array({choice})}});
}

std::string ResponseWriter::generate_event(const char* finish_reason) const {
  json finish = finish_reason ? json{{"type", finish_reason}} : json(nullptr);
  return sse({{"text", text_.emitted()}, {"output_ids", tokens_}, {"meta_info", generate_meta(std::move(finish))}});
}

std::string ResponseWriter::next_events(std::chrono::milliseconds timeout) {
  if (done_) return {};
  std::string out;
  if (endpoint_ == Endpoint::kChat && !sent_role_) {
    sent_role_ = true;
    out += sse({{"id", id_}, {"object", "chat.completion.chunk"}, {"created", created_}, {"model", model_name_},
                {"choices", json::array({{{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}},
                                          {"finish_reason", nullptr}}})}});
  }
  const RequestUpdate update = handle_->wait(tokens_.size(), timeout);
  for (size_t i = 0; i < update.new_tokens.size(); ++i) {  // one event per token: clients time every token
    const int32_t token = update.new_tokens[i];
    tokens_.push_back(token);
    const model::TokenLogprob* logprob = nullptr;
    if (i < update.new_logprobs.size()) {
      logprobs_.push_back(update.new_logprobs[i]);
      logprob = &logprobs_.back();
    }
    const std::string delta = text_.push(std::span<const int32_t>(&token, 1));
    out += endpoint_ == Endpoint::kGenerate ? generate_event(nullptr)
                                            : chunk(delta, std::span<const int32_t>(&token, 1), nullptr, logprob);
  }
  if (!update.finished) return out;
  const std::string rest = text_.finish(handle_->stop_text_length());
  const char* reason = finish_reason_name(update.reason);
  if (endpoint_ == Endpoint::kGenerate) {
    out += generate_event(reason);
  } else {
    out += chunk(rest, {}, reason);
    if (include_usage_) {
      out += sse({{"id", id_}, {"object", endpoint_ == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
                  {"created", created_}, {"model", model_name_}, {"choices", json::array()}, {"usage", usage()}});
    }
  }
  out += "data: [DONE]\n\n";
  done_ = true;
  return out;
}

}  // namespace fulcrum::server
