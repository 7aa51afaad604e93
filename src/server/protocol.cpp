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
  for (const auto& item : obj.items()) {
    const std::string& key = item.key();  // not a structured binding: clang 14 (the fuzz build) cannot capture one
    const bool ok = std::any_of(known.begin(), known.end(), [&](const char* k) { return key == k; });
    FULCRUM_REQUIRE(ok, "unknown field '{}' in {}", eplb::printable_excerpt(key), where);
  }
}

const json* field(const json& obj, const char* name) {
  const auto it = obj.find(name);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

// A field Fulcrum does not implement is refused only when it asks for something: absent, null, or an empty
// list, string or object (SGLang's frontend sends `stop_regex: []` on every request) ask for nothing.
bool asks_nothing(const json& obj, const char* name) {
  const json* v = field(obj, name);
  if (v == nullptr) return true;
  if (v->is_string()) return v->get_ref<const std::string&>().empty();  // json::empty() is false for any string
  return (v->is_array() || v->is_object()) && v->empty();
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

constexpr int64_t kMaxChoices = 64;  // prompts x n of one request
constexpr int64_t kMaxCompletionLogprobs = 5;  // OpenAI's limit on completions 'logprobs'
static_assert(kMaxCompletionLogprobs <= model::kMaxTopLogprobs);

// One request per (prompt, choice) from the template `p`: choice j of a prompt draws with seed + j (distinct
// streams; choice 0 keeps the request's seed), or, without a seed, with one derived from its own request id.
void expand_choices(const std::vector<std::vector<int32_t>>& prompts, RequestParams p, ParsedRequest& out) {
  FULCRUM_REQUIRE(static_cast<int64_t>(prompts.size()) * out.n <= kMaxChoices,
                  "{} prompts x n {} is more than {} choices", prompts.size(), out.n, kMaxChoices);
  FULCRUM_REQUIRE(!out.stream || prompts.size() * out.n == 1,
                  "streaming more than one choice (n > 1 or a list of prompts) is not implemented");
  for (const auto& prompt : prompts) {
    for (int j = 0; j < out.n; ++j) {
      RequestParams r = p;
      r.prompt = prompt;
      if (p.seed) r.seed = *p.seed + static_cast<uint64_t>(j);
      out.requests.push_back(std::move(r));
    }
  }
}

// Fields shared by completions and chat; `max_tokens_names` lists the accepted spellings. Fills
// out.requests[0] (the template) and out.n.
void parse_openai_common(const json& body, const ProtocolContext& ctx, std::initializer_list<const char*> max_tokens_names,
                         RequestParams& p, ParsedRequest& out) {
  if (const json* v = field(body, "model")) {
    FULCRUM_REQUIRE(v->is_string(), "'model' must be a string");
    if (v->get<std::string>() != ctx.model_name) {
      throw ApiError(404, "model_not_found", fmt::format("model '{}' is not served here (serving '{}')",
                                                         eplb::printable_excerpt(v->get<std::string>()),
                                                         ctx.model_name));
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
  if (const json* v = field(body, "n")) out.n = static_cast<int>(integer(*v, "n", 1, kMaxChoices));
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
  check_known(body, {"model", "prompt", "logprobs", "echo", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                     "ignore_eos", "n", "stream", "stream_options"},
              "a completion request");
  ParsedRequest out;
  const json* prompt = field(body, "prompt");
  FULCRUM_REQUIRE(prompt != nullptr, "'prompt' is required");
  std::vector<std::vector<int32_t>> prompts;
  const char* shape = "'prompt' must be a string, a list of token ids, or a list of strings or of token-id lists";
  if (prompt->is_string()) {
    prompts.push_back(encode(ctx, prompt->get<std::string>()));
  } else {
    FULCRUM_REQUIRE(prompt->is_array() && !prompt->empty(), "{}", shape);
    if ((*prompt)[0].is_number()) {
      prompts.push_back(token_ids(*prompt, "prompt"));
    } else {
      for (const json& one : *prompt) {
        FULCRUM_REQUIRE(one.is_string() || one.is_array(), "{}", shape);
        prompts.push_back(one.is_string() ? encode(ctx, one.get<std::string>()) : token_ids(one, "prompt"));
      }
    }
  }
  RequestParams p;
  if (const json* v = field(body, "echo")) out.format.echo = boolean(*v, "echo");
  // max_tokens 0 with echo: the prompt only (the one token a prefill ends in is dropped).
  const json* max_tokens = field(body, "max_tokens");
  const bool zero = max_tokens != nullptr && max_tokens->is_number_integer() && max_tokens->get<int64_t>() == 0;
  FULCRUM_REQUIRE(!zero || out.format.echo, "'max_tokens' 0 needs 'echo' true");
  json rest = body;
  if (zero) rest.erase("max_tokens");
  parse_openai_common(rest, ctx, {"max_tokens"}, p, out);
  if (zero) {
    p.max_tokens = 1;
    out.prefill_only = true;
  }
  if (const json* v = field(body, "logprobs")) {
    p.logprobs = out.format.logprobs = true;
    p.top_logprobs = static_cast<int>(integer(*v, "logprobs", 0, kMaxCompletionLogprobs));
    if (out.format.echo) p.prompt_logprobs_from = 1;
  }
  FULCRUM_REQUIRE(!(out.stream && out.format.echo), "'echo' with 'stream' is not implemented");
  expand_choices(prompts, std::move(p), out);
  return out;
}

ParsedRequest parse_chat_request(const json& body, const ProtocolContext& ctx) {
  check_known(body, {"model", "messages", "logprobs", "top_logprobs", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
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
  std::vector<int32_t> prompt;
  try {
    prompt = tokenizer::encode_chat(*ctx.tokenizer, chat);
  } catch (const Error& e) {
    throw ApiError(400, "invalid_request_error", e.what());
  }
  RequestParams p;
  parse_openai_common(body, ctx, {"max_tokens", "max_completion_tokens"}, p, out);
  if (const json* v = field(body, "logprobs")) p.logprobs = out.format.logprobs = boolean(*v, "logprobs");
  if (const json* v = field(body, "top_logprobs")) {
    FULCRUM_REQUIRE(p.logprobs, "'top_logprobs' needs 'logprobs' true");
    p.top_logprobs = static_cast<int>(integer(*v, "top_logprobs", 0, model::kMaxTopLogprobs));
  }
  expand_choices({prompt}, std::move(p), out);
  return out;
}

ParsedRequest parse_generate_request(const json& body, const ProtocolContext& ctx) {
  check_known(body, {"input_ids", "text", "sampling_params", "stream", "rid", "return_logprob", "logprob_start_len",
                     "top_logprobs_num", "return_text_in_logprobs", "image_data", "lora_path", "modalities",
                     "session_params", "custom_logit_processor", "return_hidden_states", "input_embeds"},
              "a generate request");
  // Fields RuntimeEndpoint and SGLang's Runtime may send that Fulcrum does not implement: null, empty or false pass.
  for (const char* name : {"image_data", "lora_path", "modalities", "session_params", "custom_logit_processor",
                           "input_embeds"}) {
    FULCRUM_REQUIRE(asks_nothing(body, name), "'{}' is not implemented", name);
  }
  if (const json* v = field(body, "return_hidden_states")) {
    FULCRUM_REQUIRE(!boolean(*v, "return_hidden_states"), "'return_hidden_states' true is not implemented");
  }
  ParsedRequest out;
  const json* ids = field(body, "input_ids");
  const json* text = field(body, "text");
  FULCRUM_REQUIRE((ids != nullptr) != (text != nullptr), "give exactly one of 'input_ids' and 'text'");
  std::vector<std::vector<int32_t>> prompts;
  if (ids) {
    FULCRUM_REQUIRE(ids->is_array() && !ids->empty(), "'input_ids' must be a list of token ids or a list of them");
    out.batched = (*ids)[0].is_array();
    if (out.batched) {
      for (const json& one : *ids) prompts.push_back(token_ids(one, "input_ids"));
    } else {
      prompts.push_back(token_ids(*ids, "input_ids"));
    }
  } else if (text->is_array()) {
    FULCRUM_REQUIRE(!text->empty(), "'text' must be a string or a non-empty list of strings");
    out.batched = true;
    for (const json& one : *text) {
      FULCRUM_REQUIRE(one.is_string(), "'text' must be a string or a list of strings");
      prompts.push_back(encode(ctx, one.get<std::string>()));
    }
  } else {
    FULCRUM_REQUIRE(text->is_string(), "'text' must be a string or a list of strings");
    prompts.push_back(encode(ctx, text->get<std::string>()));
  }
  if (const json* v = field(body, "stream")) out.stream = boolean(*v, "stream");
  RequestParams p;
  p.max_tokens = ctx.default_max_tokens;
  bool ignore_eos = false;
  if (const json* sp = field(body, "sampling_params")) {
    FULCRUM_REQUIRE(sp->is_object(), "'sampling_params' must be an object");
    check_known(*sp, {"max_new_tokens", "temperature", "top_p", "top_k", "seed", "sampling_seed", "stop", "stop_token_ids",
                      "ignore_eos", "n", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                      "min_new_tokens", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "regex",
                      "json_schema", "ebnf", "structural_tag", "stop_regex", "logit_bias", "custom_params"},
                "sampling_params");
    for (const char* name : {"regex", "json_schema", "ebnf", "structural_tag", "stop_regex", "logit_bias", "custom_params"}) {
      FULCRUM_REQUIRE(asks_nothing(*sp, name), "sampling_params '{}' is not implemented", name);
    }
    // Penalties and bounds at their neutral value change nothing; any other value is not implemented.
    const std::pair<const char*, double> neutral_values[] = {
        {"min_p", 0.0}, {"frequency_penalty", 0.0}, {"presence_penalty", 0.0}, {"repetition_penalty", 1.0},
        {"min_new_tokens", 0.0}};
    for (const auto& [name, neutral] : neutral_values) {
      if (const json* v = field(*sp, name)) {
        FULCRUM_REQUIRE(number(*v, name) == neutral, "sampling_params '{}' other than {} is not implemented", name, neutral);
      }
    }
    // The text keeps what was generated: EOS ends generation before it enters the text, and Fulcrum's
    // detokenizer has no special-token skipping (README: "SGLang's native API").
    for (const char* name : {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}) {
      if (const json* v = field(*sp, name)) boolean(*v, name);
    }
    if (const json* v = field(*sp, "max_new_tokens")) {
      const int max_new = static_cast<int>(integer(*v, "max_new_tokens", 0, 1 << 24));
      out.prefill_only = max_new == 0;
      p.max_tokens = std::max(1, max_new);  // prefill only: the one token the prefill ends in is dropped
    }
    if (const json* v = field(*sp, "temperature")) p.sampling.temperature = static_cast<float>(number(*v, "temperature"));
    if (const json* v = field(*sp, "top_p")) p.sampling.top_p = static_cast<float>(number(*v, "top_p"));
    if (const json* v = field(*sp, "top_k")) p.sampling.top_k = std::max(0, static_cast<int>(integer(*v, "top_k", -1, 1 << 24)));
    for (const char* name : {"seed", "sampling_seed"}) {
      if (const json* v = field(*sp, name)) p.seed = static_cast<uint64_t>(integer(*v, name, 0, std::numeric_limits<int64_t>::max()));
    }
    if (const json* v = field(*sp, "stop")) p.stop = stop_strings(*v);
    if (const json* v = field(*sp, "stop_token_ids")) p.stop_token_ids = token_ids(*v, "stop_token_ids");
    if (const json* v = field(*sp, "ignore_eos")) ignore_eos = boolean(*v, "ignore_eos");
    if (const json* v = field(*sp, "n")) out.n = static_cast<int>(integer(*v, "n", 1, kMaxChoices));
  }
  if (!ignore_eos) p.stop_token_ids.insert(p.stop_token_ids.end(), ctx.eos_token_ids.begin(), ctx.eos_token_ids.end());
  out.batched = out.batched || out.n > 1;
  FULCRUM_REQUIRE(!(out.stream && out.prefill_only), "'stream' with max_new_tokens 0 is not implemented");
  if (const json* v = field(body, "return_logprob")) p.logprobs = out.format.logprobs = boolean(*v, "return_logprob");
  if (const json* v = field(body, "top_logprobs_num")) {
    p.top_logprobs = static_cast<int>(integer(*v, "top_logprobs_num", 0, model::kMaxTopLogprobs));
  }
  if (const json* v = field(body, "return_text_in_logprobs")) {
    out.format.return_text_in_logprobs = boolean(*v, "return_text_in_logprobs");
    FULCRUM_REQUIRE(!out.format.return_text_in_logprobs || ctx.tokenizer != nullptr,
                    "'return_text_in_logprobs' needs a tokenizer; this server has none");
  }
  int64_t start = -1;  // SGLang's default: the last prompt token only
  if (const json* v = field(body, "logprob_start_len")) start = integer(*v, "logprob_start_len", -1, 1 << 30);
  if (!p.logprobs) p.top_logprobs = 0;  // SGLang reports no logprob without return_logprob
  out.format.top_logprobs = p.top_logprobs;
  expand_choices(prompts, std::move(p), out);
  if (out.format.logprobs) {
    // Entry 0 of input_token_logprobs is null (SGLang's shape), so positions start + 1.. need prompt rows.
    for (RequestParams& r : out.requests) {
      const auto length = static_cast<int64_t>(r.prompt.size());
      FULCRUM_REQUIRE(start < length, "'logprob_start_len' {} must be below the prompt's {} tokens", start, length);
      r.prompt_logprobs_from = (start < 0 ? length - 1 : start) + 1;
    }
    out.format.logprob_start_len = start;  // -1 resolved per prompt by the writer
  }
  return out;
}

}  // namespace fulcrum::server
