#pragma once
// Request bodies of /v1/completions, /v1/chat/completions and /generate, parsed strictly: malformed JSON,
// unknown fields and wrong types are ApiErrors (400), so a client's typo never passes silently.
//
// Sampling fields (OpenAI names): max_tokens, temperature, top_p, top_k (-1 or 0: off), seed, stop (string
// or list), stop_token_ids, ignore_eos, n (1 only), stream, stream_options.include_usage, model (must
// name the served model). Chat also takes max_completion_tokens. /generate takes SGLang's shape:
// {"input_ids": [...] | "text": "...", "sampling_params": {max_new_tokens, temperature, top_p, top_k, seed,
// stop, stop_token_ids, ignore_eos}, "stream": bool}.
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
  RequestParams params;
  bool stream = false;
  bool include_usage = false;
};

// The body as a JSON object; 400 when it is not JSON or not an object.
nlohmann::json parse_json_body(const std::string& body);

ParsedRequest parse_completion_request(const nlohmann::json& body, const ProtocolContext& ctx);
ParsedRequest parse_chat_request(const nlohmann::json& body, const ProtocolContext& ctx);
ParsedRequest parse_generate_request(const nlohmann::json& body, const ProtocolContext& ctx);

}  // namespace fulcrum::server
