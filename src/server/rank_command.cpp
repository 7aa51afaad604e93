#include "server/rank_command.hpp"

#include <cstring>
#include <string>

#include <fmt/format.h>

#include "eplb/error.hpp"

namespace fulcrum::server {
namespace {

class Writer {
 public:
  template <class T>
  void pod(const T& value) {
    const auto* p = reinterpret_cast<const std::byte*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  template <class T>
  void list(const std::vector<T>& values) {
    pod(static_cast<int64_t>(values.size()));
    const auto* p = reinterpret_cast<const std::byte*>(values.data());
    bytes_.insert(bytes_.end(), p, p + values.size() * sizeof(T));
  }
  std::vector<std::byte> take() { return std::move(bytes_); }

 private:
  std::vector<std::byte> bytes_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : bytes_(bytes) {}
  template <class T>
  T pod() {
    FULCRUM_CHECK(at_ + sizeof(T) <= bytes_.size(), "rank command: truncated at byte {} of {}", at_, bytes_.size());
    T value;
    std::memcpy(&value, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }
  template <class T>
  std::vector<T> list() {
    const auto n = pod<int64_t>();
    FULCRUM_CHECK(n >= 0 && static_cast<uint64_t>(n) <= (bytes_.size() - at_) / sizeof(T),
                  "rank command: a list of {} items at byte {} of {}", n, at_, bytes_.size());
    std::vector<T> values(static_cast<size_t>(n));
    std::memcpy(values.data(), bytes_.data() + at_, values.size() * sizeof(T));
    at_ += values.size() * sizeof(T);
    return values;
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  std::span<const std::byte> bytes_;
  size_t at_ = 0;
};

}  // namespace

std::vector<std::byte> encode(const RankCommand& c) {
  Writer w;
  w.pod(static_cast<int32_t>(c.kind));
  w.list(c.releases);
  switch (c.kind) {
    case RankCommand::Kind::kAdd:
    case RankCommand::Kind::kAddOnPages:
      w.pod(c.id);
      w.pod(c.capacity);
      w.pod(c.dp_group);
      w.list(c.page_ids);
      w.pod(c.num_cached_tokens);
      w.pod(c.copy_source_page);
      break;
    case RankCommand::Kind::kPass:
      w.list(c.batch_ids);
      for (const auto& tokens : c.batch_tokens) w.list(tokens);
      w.list(c.batch_last_rows);
      w.pod(c.pass_idx);
      w.pod(static_cast<uint8_t>(c.record_routing));
      break;
    case RankCommand::Kind::kStop:
      break;
  }
  return w.take();
}

RankCommand decode_rank_command(std::span<const std::byte> bytes) {
  Reader r(bytes);
  RankCommand c;
  const auto kind = r.pod<int32_t>();
  FULCRUM_CHECK(kind >= 1 && kind <= 4, "rank command: unknown kind {}", kind);
  c.kind = static_cast<RankCommand::Kind>(kind);
  c.releases = r.list<model::SequenceId>();
  switch (c.kind) {
    case RankCommand::Kind::kAdd:
    case RankCommand::Kind::kAddOnPages:
      c.id = r.pod<model::SequenceId>();
      c.capacity = r.pod<int64_t>();
      c.dp_group = r.pod<int32_t>();
      c.page_ids = r.list<int32_t>();
      c.num_cached_tokens = r.pod<int64_t>();
      c.copy_source_page = r.pod<int32_t>();
      break;
    case RankCommand::Kind::kPass:
      c.batch_ids = r.list<model::SequenceId>();
      for (size_t i = 0; i < c.batch_ids.size(); ++i) c.batch_tokens.push_back(r.list<int32_t>());
      c.batch_last_rows = r.list<int64_t>();
      FULCRUM_CHECK(c.batch_last_rows.size() == c.batch_ids.size(), "rank command: {} row counts for {} entries",
                    c.batch_last_rows.size(), c.batch_ids.size());
      c.pass_idx = r.pod<uint64_t>();
      c.record_routing = r.pod<uint8_t>() != 0;
      break;
    case RankCommand::Kind::kStop:
      break;
  }
  FULCRUM_CHECK(r.done(), "rank command: {} bytes left over", bytes.size());
  return c;
}

void broadcast_command(comm::Communicator& world, RankCommand& command) {
  std::vector<std::byte> bytes;
  if (world.rank() == 0) bytes = encode(command);
  int64_t size = static_cast<int64_t>(bytes.size());
  world.broadcast(comm::writable_bytes_of(std::span<int64_t>(&size, 1)), 0);
  bytes.resize(static_cast<size_t>(size));
  world.broadcast(bytes, 0);
  if (world.rank() != 0) command = decode_rank_command(bytes);
}

std::vector<std::string> gather_errors(comm::Communicator& world, const std::string& mine) {
  const int n = world.size();
  const int64_t my_size = static_cast<int64_t>(mine.size());
  std::vector<int64_t> sizes(static_cast<size_t>(n));
  world.all_gather(comm::bytes_of(std::span<const int64_t>(&my_size, 1)), comm::writable_bytes_of(std::span<int64_t>(sizes)));
  int64_t total = 0;
  for (const int64_t s : sizes) total += s;
  std::vector<std::byte> all(static_cast<size_t>(total));
  world.all_gather_v(std::as_bytes(std::span<const char>(mine)), all, sizes);
  std::vector<std::string> errors;
  size_t at = 0;
  for (const int64_t s : sizes) {
    errors.emplace_back(reinterpret_cast<const char*>(all.data()) + at, static_cast<size_t>(s));
    at += static_cast<size_t>(s);
  }
  return errors;
}

}  // namespace fulcrum::server
