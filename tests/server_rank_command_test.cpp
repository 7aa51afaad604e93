// The message that carries a step to the other rank processes (serve --multi-process): encode / decode round
// trips for every kind, and malformed bytes are one-line errors, never a crash or a silent half-read.
#include <gtest/gtest.h>

#include "eplb/error.hpp"
#include "server/rank_command.hpp"

namespace fulcrum::server {
namespace {

RankCommand pass_command() {
  RankCommand c;
  c.kind = RankCommand::Kind::kPass;
  c.releases = {7, 9};
  c.batch_ids = {3, 4};
  c.batch_tokens = {{1, 2, 3}, {5}};
  c.batch_last_rows = {2, 1};  // sequence 3 asks logits of its last two positions (a prompt logprob)
  c.pass_idx = 41;
  c.record_routing = true;
  return c;
}

TEST(RankCommand, EveryKindRoundTrips) {
  RankCommand add;
  add.kind = RankCommand::Kind::kAddOnPages;
  add.id = 12;
  add.capacity = 300;
  add.dp_group = 1;
  add.page_ids = {4, 5, 6};
  add.num_cached_tokens = 34;
  add.copy_source_page = 9;  // rows [0, 2) of page 9 copied into page 6 (page size 16)
  RankCommand stop;
  stop.kind = RankCommand::Kind::kStop;
  for (const RankCommand& c : {pass_command(), add, stop}) EXPECT_EQ(decode_rank_command(encode(c)), c);
}

TEST(RankCommand, MalformedBytesAreOneLineErrors) {
  const std::vector<std::byte> bytes = encode(pass_command());
  for (const size_t cut : {size_t{0}, size_t{3}, bytes.size() / 2, bytes.size() - 1}) {
    EXPECT_THROW(decode_rank_command(std::span(bytes).first(cut)), Error) << "cut at " << cut;
  }
  std::vector<std::byte> longer = bytes;
  longer.push_back(std::byte{0});
  EXPECT_THROW(decode_rank_command(longer), Error);
  RankCommand mismatched = pass_command();
  mismatched.batch_last_rows = {1};  // one row count for two entries
  EXPECT_THROW(decode_rank_command(encode(mismatched)), Error);
}

}  // namespace
}  // namespace fulcrum::server
