#pragma once
// Qwen3's chat format (ChatML). Each message is
//   <|im_start|>{role}\n{content}<|im_end|>\n
// and the generation prompt that asks the model to answer is
//   <|im_start|>assistant\n
// This is the plain template: no system-prompt injection, tool calls or <think> handling.
#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.hpp"

namespace fulcrum::tokenizer {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
};

std::string format_chat(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true);

// format_chat then encode; throws when the tokenizer lacks <|im_start|> or <|im_end|> as added tokens,
// since the markers would otherwise be spelled out as ordinary text.
std::vector<int32_t> encode_chat(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt = true);

}  // namespace fulcrum::tokenizer
