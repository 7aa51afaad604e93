#pragma once
// CUDA graphs of the engine's decode steps, one per (batch size, KV-length bucket): the step's launches are
// captured once and replayed with the step's inputs rewritten in place (fixed device addresses, StepLayout).
// A capture that fails (a library call that cannot be captured) marks its key, whose steps then run eagerly.
// No CUDA header here.
#include <cstdint>
#include <functional>
#include <map>
#include <utility>

struct CUstream_st;
struct CUgraphExec_st;

namespace fulcrum::gpu {

using GraphKey = std::pair<int, int64_t>;  // (sequences, KV-length bucket)

struct GraphCache {
  GraphCache() = default;
  ~GraphCache();
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  bool contains(const GraphKey& key) const { return graphs_.count(key) != 0; }
  // Captures what `launches` enqueues on `stream` (nothing runs) and keeps it under `key`; false (and the key
  // kept as uncapturable: contains() is true, replay() runs nothing and returns false) when capture failed.
  bool capture(const GraphKey& key, CUstream_st* stream, const std::function<void()>& launches);
  // Launches the graph of `key` on `stream`; false when the key's capture had failed.
  bool replay(const GraphKey& key, CUstream_st* stream);
  size_t size() const { return graphs_.size(); }
  void clear();

 private:
  std::map<GraphKey, CUgraphExec_st*> graphs_;  // null: capture failed
};

}  // namespace fulcrum::gpu
