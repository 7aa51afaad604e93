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
//
// Logprobs (log-softmax of the raw logits at temperature 1, before top-k / top-p: the model's distribution, as
// vLLM reports by default): completions `logprobs` N in [0, 5] (OpenAI's limit; N most likely per position) and
// `echo` (the prompt first; with logprobs its tokens' logprobs too, the first null; max_tokens 0 then allowed:
// the prompt only, as lm-eval's scoring request reads it); chat `logprobs` true with `top_logprobs` in [0, 20];
// /generate `return_logprob` with `logprob_start_len` (-1: the last prompt token), `top_logprobs_num` in
// [0, 20] and `return_text_in_logprobs`. Out-of-range values are 400s.
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

// How a response reports logprobs (the engine side is in RequestParams).
struct LogprobFormat {
  bool logprobs = false;               // completions logprobs, chat logprobs, generate return_logprob
  bool echo = false;                   // completions: the prompt's text (and its logprobs) before the output
  int64_t logprob_start_len = 0;       // generate: input_token_logprobs cover prompt[start..] (entry 0 null)
  bool return_text_in_logprobs = false;  // generate: each [logprob, id, text] carries the text, not null
  int top_logprobs = 0;                // generate: input_ and output_top_logprobs when > 0
};

struct ParsedRequest {
  std::vector<RequestParams> requests;  // one per choice: prompt-major, then the n choices of each prompt
  int n = 1;                            // choices per prompt
  bool stream = false;
  bool include_usage = false;
  bool batched = false;       // /generate: a list of prompts (or n > 1) in, a list of objects out
  bool prefill_only = false;  // /generate max_new_tokens 0, completions max_tokens 0 (with echo): the prompt
                              // is run, no token is returned
  LogprobFormat format;
};

// The body as a JSON object; 400 when it is not JSON or not an object.
nlohmann::json parse_json_body(const std::string& body);

ParsedRequest parse_completion_request(const nlohmann::json& body, const ProtocolContext& ctx);
ParsedRequest parse_chat_request(const nlohmann::json& body, const ProtocolContext& ctx);
ParsedRequest parse_generate_request(const nlohmann::json& body, const ProtocolContext& ctx);

}  // namespace fulcrum::server
