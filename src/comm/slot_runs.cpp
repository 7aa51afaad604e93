#include "comm/slot_runs.hpp"

#include "eplb/error.hpp"

namespace fulcrum::comm {

namespace {

// 1 where a run of consecutive indices starts (index[i] != index[i-1] + 1).
std::vector<uint8_t> run_starts(const std::vector<const SlotRunItem*>& items) {
  std::vector<uint8_t> starts(items.size());
  for (size_t i = 0; i < items.size(); ++i) starts[i] = i == 0 || items[i]->index != items[i - 1]->index + 1;
  return starts;
}

// One op per tensor for each segment of `items`, cut where this side's or the peer's runs start.
template <typename Op>
void add_segments(const std::vector<const SlotRunItem*>& items, std::vector<uint8_t>& starts,
                  const std::vector<uint8_t>& peer_starts, int peer, int64_t gate_up_bytes, int64_t down_bytes,
                  std::vector<Op>& ops) {
  for (size_t i = 0; i < items.size(); ++i) starts[i] |= peer_starts[i];
  for (size_t i = 0; i < items.size();) {
    size_t j = i + 1;
    while (j < items.size() && starts[j] == 0) ++j;
    const auto k = static_cast<int64_t>(j - i);
    ops.push_back({items[i]->gate_up, k * gate_up_bytes, peer});
    ops.push_back({items[i]->down, k * down_bytes, peer});
    i = j;
  }
}

}  // namespace

SlotRunOps merge_slot_runs(Communicator& host, std::span<const SlotRunItem> sends, std::span<const SlotRunItem> recvs,
                           int64_t gate_up_bytes, int64_t down_bytes) {
  const int size = host.size();
  std::vector<std::vector<const SlotRunItem*>> out(size), in(size);
  const auto file = [&host, size](const SlotRunItem& item, auto& per_peer) {
    FULCRUM_CHECK(item.peer >= 0 && item.peer < size && item.peer != host.rank(),
                  "slot runs: peer {} is not another rank of {}", item.peer, size);
    per_peer[item.peer].push_back(&item);
  };
  for (const SlotRunItem& item : sends) file(item, out);
  for (const SlotRunItem& item : recvs) file(item, in);
  // Run starts, each rank's own first (as sender, then as receiver: buffered host sends), then the peer's.
  std::vector<std::vector<uint8_t>> out_starts(size), in_starts(size);
  for (int peer = 0; peer < size; ++peer) {
    out_starts[peer] = run_starts(out[peer]);
    in_starts[peer] = run_starts(in[peer]);
    if (!out[peer].empty()) host.send(std::as_bytes(std::span<const uint8_t>(out_starts[peer])), peer);
    if (!in[peer].empty()) host.send(std::as_bytes(std::span<const uint8_t>(in_starts[peer])), peer);
  }
  SlotRunOps ops;
  for (int peer = 0; peer < size; ++peer) {
    std::vector<uint8_t> peer_starts;
    if (!in[peer].empty()) {  // the peer's runs as sender
      peer_starts.resize(in[peer].size());
      host.recv(std::as_writable_bytes(std::span<uint8_t>(peer_starts)), peer);
      add_segments(in[peer], in_starts[peer], peer_starts, peer, gate_up_bytes, down_bytes, ops.recvs);
    }
    if (!out[peer].empty()) {  // the peer's runs as receiver
      peer_starts.resize(out[peer].size());
      host.recv(std::as_writable_bytes(std::span<uint8_t>(peer_starts)), peer);
      add_segments(out[peer], out_starts[peer], peer_starts, peer, gate_up_bytes, down_bytes, ops.sends);
    }
  }
  return ops;
}

}  // namespace fulcrum::comm
