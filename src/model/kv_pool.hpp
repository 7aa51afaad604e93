#pragma once
// The paged key/value memory of one model object (one rank's stage shard), shared by all its sequences.
//
// NOTES: per owned layer one K and one V tensor [num_pages * page_size, num_kv_heads, head_dim]; page p is
// rows [p * page_size, (p + 1) * page_size) of every one of them (one page id covers all layers). A
// sequence's KvCache holds its page table; position pos lives in row KvPages::row(pos) (backend.hpp).
// Bytes: 2 * num_layers * num_pages * page_size * num_kv_heads * head_dim * sizeof(float).
//
// Two modes. Growing (the default): allocation never fails; when free pages are short the tensors are
// reallocated larger (at least doubled, whole kGrowPages chunks) and the pages in use copied over. Fixed
// (after reserve): the tensors are allocated once and never grow; a request beyond the free pages throws
// "KV pool exhausted". Growth must not run while a forward pass reads the pool (the model is not
// thread-safe); page accounting (allocate/release/counts) is, so a cache may be released from any thread.
//
// Pages chosen by the caller (map_cache): the server's scheduler owns page accounting (its prefix cache
// shares pages between sequences, server/prefix_cache.hpp) and hands each sequence its page table; such a
// cache borrows its pages (release returns nothing). Once a pool has mapped a cache it is the caller's:
// create_cache refuses, so the two never hand out the same page.
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "model/backend.hpp"

namespace fulcrum::model {

class KvPool;

// One sequence's key/value cache: a page table into its model's KvPool. Move-only; its pages go back to
// the pool when it is destroyed, released or assigned over (RAII), so a finished sequence cannot leak them.
class KvCache {
 public:
  KvCache() = default;  // holds no page, capacity 0
  ~KvCache() { release(); }
  KvCache(KvCache&& other) noexcept;
  KvCache& operator=(KvCache&& other) noexcept;
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  // Plain fields, as before paging: the model advances num_tokens; the backends check every access against
  // the page table, so a wrong value is an error, never a write outside the sequence's pages.
  int64_t capacity = 0;    // positions it can hold (as asked; its pages may hold a few more)
  int64_t num_tokens = 0;  // positions filled so far (= position of the next token)

  std::span<const int32_t> page_ids() const { return page_ids_; }  // [ceil(capacity / page_size)] in order
  bool belongs_to(const KvPool& pool) const { return pool_.lock().get() == &pool; }
  // Returns the pages to the pool now (borrowed pages: gives them up); the cache is then empty (capacity 0).
  void release() noexcept;

 private:
  friend class KvPool;
  std::weak_ptr<KvPool> pool_;  // the pool may go first (model destroyed): then there is nothing to return
  std::vector<int32_t> page_ids_;
  bool borrowed_ = false;  // pages chosen by the caller (KvPool::map_cache), not returned to the pool
};

class KvPool : public std::enable_shared_from_this<KvPool> {
 public:
  static constexpr int64_t kDefaultPageSize = 16;
  static constexpr int64_t kGrowPages = 16;  // growing mode allocates whole chunks of this many pages

  // An empty growing pool (no page yet) for `num_layers` layers of [num_kv_heads, head_dim] rows.
  KvPool(Backend& backend, int num_layers, int64_t num_kv_heads, int64_t head_dim);

  // Fixes the pool at `num_pages` pages of `page_size` positions, allocated now; needs every page free.
  void reserve(int64_t num_pages, int64_t page_size);
  // A cache of `capacity` positions: ceil(capacity / page_size) pages, lowest free ids of a fresh pool first.
  KvCache create_cache(int64_t capacity);
  // A cache of `capacity` positions over the caller's `page_ids` (ceil(capacity / page_size) distinct ids
  // in [0, num_pages)); positions [0, num_cached_tokens) already hold this sequence's K/V (pages shared
  // with an earlier sequence), so num_tokens starts there. A growing pool grows to cover the ids.
  // copy_source_page >= 0 (model::SequencePages::copy_source_page): rows [0, num_cached_tokens % page_size)
  // of that page are first copied into page_ids[num_cached_tokens / page_size] on every layer.
  KvCache map_cache(std::span<const int32_t> page_ids, int64_t capacity, int64_t num_cached_tokens,
                    int32_t copy_source_page = -1);

  int64_t page_size() const { return page_size_; }
  bool fixed() const { return fixed_; }
  int64_t num_pages() const;
  int64_t num_free_pages() const;
  int64_t num_used_pages() const { return num_pages() - num_free_pages(); }
  int64_t bytes() const;  // memory of all K and V tensors

  const Tensor& k(size_t local_layer_idx) const { return k_[local_layer_idx]; }  // [num_pages * page_size, kv_heads, head_dim]
  const Tensor& v(size_t local_layer_idx) const { return v_[local_layer_idx]; }
  KvPages pages_of(const KvCache& cache) const { return KvPages{cache.page_ids(), page_size_}; }

 private:
  friend class KvCache;
  void release(std::vector<int32_t>& page_ids) noexcept;
  void resize_locked(int64_t num_pages);  // keeps the rows of pages [0, min(old, new))

  Backend& backend_;
  const int num_layers_;
  const int64_t num_kv_heads_, head_dim_;
  int64_t page_size_ = kDefaultPageSize;
  bool fixed_ = false;
  bool mapped_ = false;  // map_cache was used: page accounting belongs to the caller
  mutable std::mutex mutex_;  // guards the fields below
  int64_t num_pages_ = 0;
  std::vector<int32_t> free_;  // free page ids, a stack: back() is handed out next
  std::vector<Tensor> k_, v_;  // [num_layers]
};

}  // namespace fulcrum::model
