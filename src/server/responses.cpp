#include "server/responses.hpp"

#include <fmt/format.h>

namespace fulcrum::server {
namespace {

using nlohmann::json;

std::string sse(const json& event) { return "data: " + event.dump() + "\n\n"; }

json finish_json(const char* reason) { return reason ? json(reason) : json(nullptr); }

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
                               std::string model_name, bool include_usage, bool prefill_only)
    : endpoint_(endpoint), handle_(std::move(handle)), text_(tokenizer, std::move(stop)),
      model_name_(std::move(model_name)), include_usage_(include_usage), prefill_only_(prefill_only),
      id_(fmt::format("{}-{}", endpoint == Endpoint::kChat ? "chatcmpl" : "cmpl", handle_->id())),
      created_(std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count()) {}

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
  const FinishReason finished = handle_->finish_reason();
  if (prefill_only_ && (finished == FinishReason::kStop || finished == FinishReason::kLength)) {
    tokens_.clear();
    return {{"text", ""},
            {"output_ids", json::array()},
            {"meta_info", {{"id", id_}, {"prompt_tokens", handle_->prompt_tokens()}, {"completion_tokens", 0},
                           {"finish_reason", {{"type", "length"}, {"length", 0}}}}}};
  }
  text_.push(tokens_);
  text_.finish(handle_->stop_text_length());
  const char* reason = finish_reason_name(finished);
  const std::string& text = text_.emitted();
  if (endpoint_ == Endpoint::kGenerate) {
    return {{"text", text},
            {"output_ids", tokens_},
            {"meta_info", {{"id", id_}, {"prompt_tokens", handle_->prompt_tokens()},
                           {"completion_tokens", tokens_.size()}, {"finish_reason", {{"type", reason}}}}}};
  }
  json choice = {{"index", 0}, {"finish_reason", reason}, {"token_ids", tokens_}};
  if (endpoint_ == Endpoint::kChat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
    choice["logprobs"] = nullptr;
  }
  return {{"id", id_},
          {"object", endpoint_ == Endpoint::kChat ? "chat.completion" : "text_completion"},
          {"created", created_},
          {"model", model_name_},
          {"choices", json::array({choice})},
          {"usage", usage()}};
}

std::string ResponseWriter::chunk(const std::string& text, std::span<const int32_t> ids, const char* finish_reason) {
  json choice = {{"index", 0}, {"finish_reason", finish_json(finish_reason)}, {"token_ids", ids}};
  if (endpoint_ == Endpoint::kChat) {
    choice["delta"] = text.empty() && finish_reason ? json::object() : json{{"content", text}};
  } else {
    choice["text"] = text;
    choice["logprobs"] = nullptr;
  }
  return sse({{"id", id_},
              {"object", endpoint_ == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
              {"created", created_},
              {"model", model_name_},
              {"choices", json::array({choice})}});
}

std::string ResponseWriter::generate_event(const char* finish_reason) const {
  json finish = finish_reason ? json{{"type", finish_reason}} : json(nullptr);
  return sse({{"text", text_.emitted()},
              {"output_ids", tokens_},
              {"meta_info", {{"id", id_}, {"prompt_tokens", handle_->prompt_tokens()},
                             {"completion_tokens", tokens_.size()}, {"finish_reason", finish}}}});
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
  for (const int32_t token : update.new_tokens) {  // one event per token: clients time every token
    tokens_.push_back(token);
    const std::string delta = text_.push(std::span<const int32_t>(&token, 1));
    out += endpoint_ == Endpoint::kGenerate ? generate_event(nullptr) : chunk(delta, std::span<const int32_t>(&token, 1), nullptr);
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
