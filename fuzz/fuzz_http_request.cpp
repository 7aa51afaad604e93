// HTTP requests, as `serve` reads them off a socket: arbitrary bytes fed to RequestParser in pieces (the first
// byte picks their size, so requests split across reads are covered), pipelined requests taken one by one, and
// each complete request's body through the protocol parsers of /v1/completions, /v1/chat/completions and
// /generate (with the golden tokenizer, as serve has one). Checked: parser errors are 400/413/431 with a
// one-line reason; protocol errors are ApiErrors with a 4xx status; an accepted request is well formed.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.hpp"
#include "server/api_error.hpp"
#include "server/http_wire.hpp"
#include "server/protocol.hpp"

namespace {

using namespace fulcrum;

const server::ProtocolContext& context() {
  static const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_file(FULCRUM_FUZZ_TOKENIZER);
  static const server::ProtocolContext ctx = [] {
    server::ProtocolContext c;
    c.tokenizer = &tok;
    c.model_name = "fuzz-model";
    c.default_max_tokens = 16;
    c.eos_token_ids = {0, 2};
    return c;
  }();
  return ctx;
}

void check_parsed(const server::ParsedRequest& parsed, const std::string& body) {
  if (parsed.n < 1 || parsed.requests.empty() || parsed.requests.size() % parsed.n != 0) {
    fuzz::fail("accepted request with an inconsistent choice count", body);
  }
  for (const server::RequestParams& p : parsed.requests) {
    if (p.max_tokens < (parsed.prefill_only ? 0 : 1)) fuzz::fail("accepted request with max_tokens < 1", body);
    // Sampling values are the scheduler's to check (Scheduler::submit answers 400), not the protocol's.
  }
}

template <typename F>
void protocol(F&& parse, const std::string& body) {
  try {
    check_parsed(parse(), body);
  } catch (const server::ApiError& e) {
    if (e.status() < 400 || e.status() >= 500) fuzz::fail("protocol error with a non-4xx status", e.what());
    fuzz::check_error_message(e.what());
  } catch (const std::exception& e) {
    fuzz::fail("protocol parsing threw something other than an ApiError", e.what());
  }
}

void handle(const server::HttpRequest& request) {
  nlohmann::json body;
  try {
    body = server::parse_json_body(request.body);
  } catch (const server::ApiError& e) {
    if (e.status() != 400) fuzz::fail("body error with a status other than 400", e.what());
    fuzz::check_error_message(e.what());
    return;
  } catch (const std::exception& e) {
    fuzz::fail("parse_json_body threw something other than an ApiError", e.what());
  }
  const server::ProtocolContext& ctx = context();
  protocol([&] { return server::parse_completion_request(body, ctx); }, request.body);
  protocol([&] { return server::parse_chat_request(body, ctx); }, request.body);
  protocol([&] { return server::parse_generate_request(body, ctx); }, request.body);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t piece = 1 + data[0] % 64 * 4;  // 1..253 bytes per read
  const char* in = reinterpret_cast<const char*>(data + 1);
  const size_t in_size = size - 1;
  // Small limits, so that inputs of a few KiB reach every 413 and 431.
  server::HttpLimits limits;
  limits.max_body_bytes = 2048;
  limits.max_header_bytes = 1024;
  limits.max_headers = 16;
  server::RequestParser parser(limits);
  size_t pos = 0;  // bytes consumed
  size_t received = 0;  // bytes "read off the socket" so far
  while (pos < in_size) {
    received = std::max(received, std::min(in_size, pos + piece));
    const size_t available = received - pos;
    const size_t consumed = parser.feed(in + pos, available);
    pos += consumed;
    parser.take_continue_due();
    if (parser.state() == server::RequestParser::State::kError) {
      const int status = parser.error_status();
      if (status != 400 && status != 413 && status != 431) fuzz::fail("parser error status", parser.error_message());
      fuzz::check_error_message(parser.error_message());
      return 0;
    }
    if (parser.state() == server::RequestParser::State::kComplete) {
      handle(parser.take());
      continue;
    }
    // Needing more bytes while leaving some of those it was given would stall the connection.
    if (consumed < available) fuzz::fail("the parser wants more bytes but left some unread", "");
  }
  return 0;
}
