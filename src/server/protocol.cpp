#include "server/protocol.hpp"

#include <algorithm>
#include <limits>

#include "eplb/json_text.hpp"
#include "server/api_error.hpp"
#include "tokenizer/chat.hpp"

namespace fulcrum::server {
namespace {

using nlohmann::json;

void check_known(const json& obj, std::initializer_list<const char*> known, const char* where) {
  for (const auto& [key, value] : obj.items()) {
    const bool ok = std::any_of(known.begin(), known.end(), [&](const char* k) { return key == k; });
    FULCRUM_REQUIRE(ok, "unknown field '{}' in {}", key, where);
  }
}

const json* field(const json& obj, const char* name) {
  const auto it = obj.find(name);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

int64_t integer(const json& v, const char* name, int64_t lo, int64_t hi) {
  FULCRUM_REQUIRE(v.is_number_integer(), "'{}' must be an integer", name);
  const int64_t x = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi) ? hi + 1 : v.get<int64_t>();
  FULCRUM_REQUIRE(x >= lo && x <= hi, "'{}' must be in [{}, {}], got {}", name, lo, hi, eplb::json_excerpt(v));
  return x;
}

double number(const json& v, const char* name) {
  FULCRUM_REQUIRE(v.is_number(), "'{}' must be a number", name);
  return v.get<double>();
}

bool boolean(const json& v, const char* name) {
  FULCRUM_REQUIRE(v.is_boolean(), "'{}' must be a boolean", name);
  return v.get<bool>();
}

std::vector<int32_t> token_ids(const json& v, const char* name) {
  FULCRUM_REQUIRE(v.is_array(), "'{}' must be a list of token ids", name);
  std::vector<int32_t> ids;
  for (const json& x : v) ids.push_back(static_cast<int32_t>(integer(x, name, 0, std::numeric_limits<int32_t>::max())));
  return ids;
}

std::vector<std::string> stop_strings(const json& v) {
  if (v.is_string()) return {v.get<std::string>()};
  FULCRUM_REQUIRE(v.is_array(), "'stop' must be a string or a list of strings");
  std::vector<std::string> out;
  for (const json& s : v) {
    FULCRUM_REQUIRE(s.is_string(), "'stop' must be a string or a list of strings");
    out.push_back(s.get<std::string>());
  }
  return out;
}

std::vector<int32_t> encode(const ProtocolContext& ctx, const std::string& text) {
  FULCRUM_REQUIRE(ctx.tokenizer != nullptr, "this server has no tokenizer.json: send token ids instead of text");
  try {
    return ctx.tokenizer->encode(text);
  } catch (const Error& e) {
    throw ApiError(400, "invalid_request_error", e.what());
  }
}

// Fields shared by completions and chat; `max_tokens_names` lists the accepted spellings.
void parse_openai_common(const json& body, const ProtocolContext& ctx, std::initializer_list<const char*> max_tokens_names,
                         ParsedRequest& out) {
  RequestParams& p = out.params;
  if (const json* v = field(body, "model")) {
    FULCRUM_REQUIRE(v->is_string(), "'model' must be a string");
    if (v->get<std::string>() != ctx.model_name) {
      throw ApiError(404, "model_not_found", fmt::format("model '{}' is not served here (serving '{}')",
                                                         v->get<std::string>(), ctx.model_name));
    }
  }
  p.max_tokens = ctx.default_max_tokens;
  for (const char* name : max_tokens_names) {
    if (const json* v = field(body, name)) p.max_tokens = static_cast<int>(integer(*v, name, 1, 1 << 24));
  }
  if (const json* v = field(body, "temperature")) p.sampling.temperature = static_cast<float>(number(*v, "temperature"));
  if (const json* v = field(body, "top_p")) p.sampling.top_p = static_cast<float>(number(*v, "top_p"));
  if (const json* v = field(body, "top_k")) p.sampling.top_k = std::max(0, static_cast<int>(integer(*v, "top_k", -1, 1 << 24)));
  if (const json* v = field(body, "seed")) p.seed = static_cast<uint64_t>(integer(*v, "seed", 0, std::numeric_limits<int64_t>::max()));
  if (const json* v = field(body, "stop")) p.stop = stop_strings(*v);
  if (const json* v = field(body, "stop_token_ids")) p.stop_token_ids = token_ids(*v, "stop_token_ids");
  const json* ignore = field(body, "ignore_eos");
  if (!(ignore && boolean(*ignore, "ignore_eos"))) {
    p.stop_token_ids.insert(p.stop_token_ids.end(), ctx.eos_token_ids.begin(), ctx.eos_token_ids.end());
  }
  if (const json* v = field(body, "n")) FULCRUM_REQUIRE(integer(*v, "n", 1, 1) == 1, "'n' must be 1");
  if (const json* v = field(body, "stream")) out.stream = boolean(*v, "stream");
  if (const json* v = field(body, "stream_options")) {
    FULCRUM_REQUIRE(v->is_object(), "'stream_options' must be an object");
    check_known(*v, {"include_usage"}, "stream_options");
    if (const json* u = field(*v, "include_usage")) out.include_usage = boolean(*u, "include_usage");
  }
}

}  // namespace

json parse_json_body(const std::string& body) {
  // Nesting is bounded before parsing: a 100k-deep body would overflow the parser's stack (and cost its memory).
  FULCRUM_REQUIRE(!eplb::find_json_depth_overflow(body), "the request body nests JSON deeper than {} levels",
                  eplb::kMaxJsonDepth);
  json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  FULCRUM_REQUIRE(!parsed.is_discarded(), "the request body is not valid JSON");
  FULCRUM_REQUIRE(parsed.is_object(), "the request body must be a JSON object");
  return parsed;
}

ParsedRequest parse_completion_request(const json& body, const ProtocolContext& ctx) {
  check_known(body, {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                     "ignore_eos", "n", "stream", "stream_options"},
              "a completion request");
  ParsedRequest out;
  const json* prompt = field(body, "prompt");
  FULCRUM_REQUIRE(prompt != nullptr, "'prompt' is required");
  if (prompt->is_string()) {
    out.params.prompt = encode(ctx, prompt->get<std::string>());
  } else {
    FULCRUM_REQUIRE(prompt->is_array(), "'prompt' must be a string or a list of token ids");
    out.params.prompt = token_ids(*prompt, "prompt");
  }
  parse_openai_common(body, ctx, {"max_tokens"}, out);
  return out;
}

ParsedRequest parse_chat_request(const json& body, const ProtocolContext& ctx) {
  check_known(body, {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                     "stop", "stop_token_ids", "ignore_eos", "n", "stream", "stream_options"},
              "a chat completion request");
  const json* messages = field(body, "messages");
  FULCRUM_REQUIRE(messages != nullptr && messages->is_array() && !messages->empty(), "'messages' must be a non-empty list");
  std::vector<tokenizer::ChatMessage> chat;
  for (const json& m : *messages) {
    FULCRUM_REQUIRE(m.is_object(), "each message must be an object");
    check_known(m, {"role", "content", "name"}, "a message");
    const json* role = field(m, "role");
    const json* content = field(m, "content");
    FULCRUM_REQUIRE(role && role->is_string(), "a message's 'role' must be a string");
    FULCRUM_REQUIRE(content && content->is_string(), "a message's 'content' must be a string");
    chat.push_back({role->get<std::string>(), content->get<std::string>()});
  }
  FULCRUM_REQUIRE(ctx.tokenizer != nullptr, "chat needs a tokenizer; this server has no tokenizer.json");
  ParsedRequest out;
  try {
    out.params.prompt = tokenizer::encode_chat(*ctx.tokenizer, chat);
  } catch (const Error& e) {
    throw ApiError(400, "invalid_request_error", e.what());
  }
  parse_openai_common(body, ctx, {"max_tokens", "max_completion_tokens"}, out);
  return out;
}

ParsedRequest parse_generate_request(const json& body, const ProtocolContext& ctx) {
  check_known(body, {"input_ids", "text", "sampling_params", "stream"}, "a generate request");
  ParsedRequest out;
  const json* ids = field(body, "input_ids");
  const json* text = field(body, "text");
  FULCRUM_REQUIRE((ids != nullptr) != (text != nullptr), "give exactly one of 'input_ids' and 'text'");
  if (ids) {
    out.params.prompt = token_ids(*ids, "input_ids");
  } else {
    FULCRUM_REQUIRE(text->is_string(), "'text' must be a string");
    out.params.prompt = encode(ctx, text->get<std::string>());
  }
  if (const json* v = field(body, "stream")) out.stream = boolean(*v, "stream");
  RequestParams& p = out.params;
  p.max_tokens = ctx.default_max_tokens;
  const json* sp = field(body, "sampling_params");
  if (!sp) return out;
  FULCRUM_REQUIRE(sp->is_object(), "'sampling_params' must be an object");
  check_known(*sp, {"max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos"},
              "sampling_params");
  if (const json* v = field(*sp, "max_new_tokens")) p.max_tokens = static_cast<int>(integer(*v, "max_new_tokens", 1, 1 << 24));
  if (const json* v = field(*sp, "temperature")) p.sampling.temperature = static_cast<float>(number(*v, "temperature"));
  if (const json* v = field(*sp, "top_p")) p.sampling.top_p = static_cast<float>(number(*v, "top_p"));
  if (const json* v = field(*sp, "top_k")) p.sampling.top_k = std::max(0, static_cast<int>(integer(*v, "top_k", -1, 1 << 24)));
  if (const json* v = field(*sp, "seed")) p.seed = static_cast<uint64_t>(integer(*v, "seed", 0, std::numeric_limits<int64_t>::max()));
  if (const json* v = field(*sp, "stop")) p.stop = stop_strings(*v);
  if (const json* v = field(*sp, "stop_token_ids")) p.stop_token_ids = token_ids(*v, "stop_token_ids");
  if (const json* v = field(*sp, "ignore_eos")) boolean(*v, "ignore_eos");  // no default eos for ids: accepted, no-op
  return out;
}

}  // namespace fulcrum::server
