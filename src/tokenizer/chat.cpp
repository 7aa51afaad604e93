#include "tokenizer/chat.hpp"

#include "eplb/error.hpp"

namespace fulcrum::tokenizer {

std::string format_chat(const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  std::string text;
  for (const ChatMessage& m : messages) text += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  if (add_generation_prompt) text += "<|im_start|>assistant\n";
  return text;
}

std::vector<int32_t> encode_chat(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt) {
  for (const char* marker : {"<|im_start|>", "<|im_end|>"}) {
    FULCRUM_CHECK(tokenizer.added_tokens().find_content(marker) != nullptr,
                  "chat format needs the added token {} that this tokenizer lacks", marker);
  }
  return tokenizer.encode(format_chat(messages, add_generation_prompt));
}

}  // namespace fulcrum::tokenizer
