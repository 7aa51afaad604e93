#pragma once
// Request bodies of /v1/completions, /v1/chat/completions and /generate, parsed strictly: malformed JSON,
// unknown fields and wrong types are ApiErrors (400), so a client's typo never passes silently.
//
// Sampling fields (OpenAI names): max_tokens, temperature, top_p, top_k (-1 or 0: off), seed, stop (string
// or list), stop_token_ids, ignore_eos, n (choices per prompt; choice j draws with seed + j), stream,
// stream_options.include_usage, model (must name the served model). Chat also takes max_completion_tokens.
// A completion's prompt is a string, a list of token ids, or a list of either (one choice per prompt and n).
// /generate takes SGLang's shape as its RuntimeEndpoint sends it: {"input_ids": [...] | [[...], ...] |
// "text": "..." | [...], "sampling_params": {max_new_tokens (0: prefill only), temperature, top_p, top_k,
// sampling_seed, stop, stop_token_ids, ignore_eos, n, ...}, "stream": bool}; a field SGLang knows and Fulcrum
// does not implement (regex, json_schema, image_data, return_logprob true, ...) is a 400 naming it, where null
// and the neutral value (min_p 0, frequency_penalty 0, ...) pass.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/request.hpp"
#include "tokenizer/tokenizer.hpp"

namespace fulcrum::server {

struct ProtocolContext {
  const tokenizer::Tokenizer* tokenizer = nullptr;  // null: only token-id prompts
  std::string model_name;
  int default_max_tokens = 128;
  std::vector<int32_t> eos_token_ids;  // stop ids of completions and chat unless ignore_eos
};

struct ParsedRequest {
  std::vector<RequestParams> requests;  // one per choice: prompt-major, then the n choices of each prompt
  int n = 1;                            // choices per prompt
  bool stream = false;
  bool include_usage = false;
  bool batched = false;       // /generate: a list of prompts (or n > 1) in, a list of objects out
  bool prefill_only = false;  // /generate max_new_tokens 0: the prompt is run, no token is returned
};

// The body as a JSON object; 400 when it is not JSON or not an object.
nlohmann::json parse_json_body(const std::string& body);

ParsedRequest parse_completion_request(const nlohmann::json& body, const ProtocolContext& ctx);
ParsedRequest parse_chat_request(const nlohmann::json& body, const ProtocolContext& ctx);
ParsedRequest parse_generate_request(const nlohmann::json& body, const ProtocolContext& ctx);

}  // namespace fulcrum::server
