#pragma once
// The paged KV cache of the GPU engine: per decoder layer one K and one V pool of bf16 rows
// [num_pages * page_size, num_kv_heads, head_dim] (FlashInfer's NHD page layout), one allocation for all, and the
// host-side page tables of the live sequences. Page p is rows [p * page_size, (p + 1) * page_size) of every pool;
// position pos of a sequence lives in row page_ids[pos / page_size] * page_size + pos % page_size
// (model::KvPages's rule, so the CPU reference and the engine agree on what a page table means).
// Admission is by free pages: a sequence reserves ceil(capacity / page_size) pages when it is allocated.
// Or the caller chooses the pages (allocate_on_pages: the server's prefix cache, which shares pages holding a
// common prompt prefix); such a sequence borrows them, and once used that way the pool's pages are the
// caller's (allocate refuses), so the two never hand out the same page.
// No CUDA header here.
#include <cstdint>
#include <map>
#include <span>
#include <vector>

struct CUstream_st;

namespace fulcrum::gpu {

using SequenceId = int64_t;

struct KvSequence {
  int64_t capacity = 0;
  int64_t num_tokens = 0;  // positions written so far
  std::vector<int32_t> page_ids;
  bool borrowed = false;  // pages chosen by the caller: not returned to the free list
};

class DeviceKvPool {
 public:
  // Bytes of `num_pages` pages over `num_layers` layers.
  static int64_t bytes_for(int64_t num_pages, int page_size, int num_layers, int num_kv_heads, int head_dim);

  DeviceKvPool(int64_t num_pages, int page_size, int num_layers, int num_kv_heads, int head_dim, int device_idx);
  ~DeviceKvPool();
  DeviceKvPool(const DeviceKvPool&) = delete;
  DeviceKvPool& operator=(const DeviceKvPool&) = delete;

  int page_size() const { return page_size_; }
  int64_t num_pages() const { return num_pages_; }
  int64_t num_free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t bytes() const { return bytes_for(num_pages_, page_size_, num_layers_, num_kv_heads_, head_dim_); }
  uint16_t* k(int layer_idx) const;
  uint16_t* v(int layer_idx) const;

  // Reserves the pages of a new sequence; "KV pool exhausted: need N pages, M free" when they are not there.
  void allocate(SequenceId id, int64_t capacity);
  // A sequence over the caller's `page_ids` (ceil(capacity / page_size) distinct ids), positions
  // [0, num_cached_tokens) already written (shared pages, read only). copy_source_page >= 0
  // (model::SequencePages::copy_source_page): rows [0, num_cached_tokens % page_size) of that page are copied
  // into page_ids[num_cached_tokens / page_size] on every layer's K and V pool, enqueued on `stream` (so
  // ordered before the steps that follow on it).
  void allocate_on_pages(SequenceId id, int64_t capacity, std::span<const int32_t> page_ids, int64_t num_cached_tokens,
                         int32_t copy_source_page = -1, CUstream_st* stream = nullptr);
  void release(SequenceId id);  // no-op for an id that is not live
  bool live(SequenceId id) const { return seqs_.count(id) != 0; }
  KvSequence& sequence(SequenceId id);  // throws for an id that is not live
  size_t num_live() const { return seqs_.size(); }

 private:
  int64_t num_pages_ = 0;
  int page_size_ = 0, num_layers_ = 0, num_kv_heads_ = 0, head_dim_ = 0;
  uint16_t* base_ = nullptr;
  std::vector<int32_t> free_;  // a stack: back() goes next (lowest ids first on a fresh pool)
  std::map<SequenceId, KvSequence> seqs_;
  bool mapped_ = false;  // allocate_on_pages was used
};

}  // namespace fulcrum::gpu
