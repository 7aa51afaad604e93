#include "model/kv_pool.hpp"

#include <algorithm>
#include <limits>
#include <utility>

#include "eplb/error.hpp"

namespace fulcrum::model {

KvCache::KvCache(KvCache&& other) noexcept
    : capacity(std::exchange(other.capacity, 0)),
      num_tokens(std::exchange(other.num_tokens, 0)),
      pool_(std::move(other.pool_)),
      page_ids_(std::move(other.page_ids_)),
      borrowed_(std::exchange(other.borrowed_, false)) {
  other.page_ids_.clear();
}

KvCache& KvCache::operator=(KvCache&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = std::move(other.pool_);
    page_ids_ = std::move(other.page_ids_);
    other.page_ids_.clear();
    borrowed_ = std::exchange(other.borrowed_, false);
    capacity = std::exchange(other.capacity, 0);
    num_tokens = std::exchange(other.num_tokens, 0);
  }
  return *this;
}

void KvCache::release() noexcept {
  if (!borrowed_) {
    if (const std::shared_ptr<KvPool> pool = pool_.lock()) pool->release(page_ids_);
  }
  borrowed_ = false;
  pool_.reset();
  page_ids_.clear();
  capacity = 0;
  num_tokens = 0;
}

KvPool::KvPool(Backend& backend, int num_layers, int64_t num_kv_heads, int64_t head_dim)
    : backend_(backend), num_layers_(num_layers), num_kv_heads_(num_kv_heads), head_dim_(head_dim) {}

int64_t KvPool::num_pages() const {
  std::lock_guard lock(mutex_);
  return num_pages_;
}

int64_t KvPool::num_free_pages() const {
  std::lock_guard lock(mutex_);
  return static_cast<int64_t>(free_.size());
}

int64_t KvPool::bytes() const {
  std::lock_guard lock(mutex_);
  return 2 * num_layers_ * num_pages_ * page_size_ * num_kv_heads_ * head_dim_ * static_cast<int64_t>(sizeof(float));
}

void KvPool::resize_locked(int64_t num_pages) {
  // Pool rows are addressed with int32 row indices (Backend::scatter_rows).
  FULCRUM_CHECK(num_pages > 0 && num_pages * page_size_ <= std::numeric_limits<int32_t>::max(),
                "kv pool of {} pages of {} positions: need 1 to {} positions in all", num_pages, page_size_,
                std::numeric_limits<int32_t>::max());
  const int64_t kept_rows = std::min(num_pages, num_pages_) * page_size_;
  for (int layer = 0; layer < num_layers_; ++layer) {
    for (std::vector<Tensor>* pool : {&k_, &v_}) {
      Tensor grown = backend_.zeros({num_pages * page_size_, num_kv_heads_, head_dim_});
      if (kept_rows > 0) backend_.copy(grown.rows(0, kept_rows), (*pool)[static_cast<size_t>(layer)].rows(0, kept_rows));
      if (static_cast<int>(pool->size()) <= layer) pool->push_back(grown);
      else (*pool)[static_cast<size_t>(layer)] = grown;
    }
  }
  // New ids on the stack in descending order, so that they are handed out in ascending order.
  std::vector<int32_t> fresh;
  for (int64_t page = num_pages - 1; page >= num_pages_; --page) fresh.push_back(static_cast<int32_t>(page));
  free_.reserve(static_cast<size_t>(num_pages));  // so that release() never allocates
  free_.insert(free_.begin(), fresh.begin(), fresh.end());  // below the pages freed earlier: reuse those first
  num_pages_ = num_pages;
}

void KvPool::reserve(int64_t num_pages, int64_t page_size) {
  std::lock_guard lock(mutex_);
  FULCRUM_CHECK(num_pages > 0 && page_size > 0, "reserve_kv_pool: {} pages of {} positions", num_pages, page_size);
  FULCRUM_CHECK(static_cast<int64_t>(free_.size()) == num_pages_, "reserve_kv_pool: {} pages are in use",
                num_pages_ - static_cast<int64_t>(free_.size()));
  k_.clear();
  v_.clear();
  free_.clear();
  num_pages_ = 0;
  page_size_ = page_size;
  resize_locked(num_pages);
  fixed_ = true;
}

KvCache KvPool::create_cache(int64_t capacity) {
  FULCRUM_CHECK(capacity > 0, "kv cache capacity must be positive, got {}", capacity);
  std::lock_guard lock(mutex_);
  FULCRUM_CHECK(!mapped_, "create_cache: this KV pool's pages are chosen by its caller (map_cache)");
  const int64_t need = (capacity + page_size_ - 1) / page_size_;
  const auto num_free = static_cast<int64_t>(free_.size());
  if (need > num_free) {
    FULCRUM_CHECK(!fixed_, "KV pool exhausted: need {} pages, {} free", need, num_free);
    const int64_t grown = std::max(num_pages_ + need - num_free, 2 * num_pages_);
    resize_locked((grown + kGrowPages - 1) / kGrowPages * kGrowPages);
  }
  KvCache cache;
  cache.pool_ = weak_from_this();
  FULCRUM_CHECK(!cache.pool_.expired(), "a KvPool must be owned by a std::shared_ptr");
  cache.capacity = capacity;
  cache.page_ids_.assign(free_.rbegin(), free_.rbegin() + need);
  free_.resize(free_.size() - static_cast<size_t>(need));
  return cache;
}

KvCache KvPool::map_cache(std::span<const int32_t> page_ids, int64_t capacity, int64_t num_cached_tokens,
                          int32_t copy_source_page) {
  FULCRUM_CHECK(capacity > 0, "kv cache capacity must be positive, got {}", capacity);
  FULCRUM_CHECK(num_cached_tokens >= 0 && num_cached_tokens < capacity, "kv cache: {} cached positions of {}",
                num_cached_tokens, capacity);
  std::lock_guard lock(mutex_);
  const int64_t need = (capacity + page_size_ - 1) / page_size_;
  FULCRUM_CHECK(static_cast<int64_t>(page_ids.size()) == need, "kv cache of {} positions: {} page ids, need {} of {}",
                capacity, page_ids.size(), need, page_size_);
  FULCRUM_CHECK(mapped_ || static_cast<int64_t>(free_.size()) == num_pages_,
                "map_cache: {} pages of this pool are in caches it made itself", num_pages_ - static_cast<int64_t>(free_.size()));
  int32_t max_id = -1;
  for (const int32_t id : page_ids) {
    FULCRUM_CHECK(id >= 0 && (!fixed_ || id < num_pages_), "kv cache: page id {} outside the pool's {} pages", id, num_pages_);
    max_id = std::max(max_id, id);
  }
  std::vector<int32_t> sorted(page_ids.begin(), page_ids.end());
  std::sort(sorted.begin(), sorted.end());
  FULCRUM_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "kv cache: a page id twice in one table");
  const int64_t copied_rows = num_cached_tokens % page_size_;
  FULCRUM_CHECK((copied_rows > 0) == (copy_source_page >= 0),
                "kv cache: {} cached positions of pages of {} with copy source page {}", num_cached_tokens, page_size_,
                copy_source_page);
  const int32_t copy_dest_page = copied_rows > 0 ? page_ids[static_cast<size_t>(num_cached_tokens / page_size_)] : -1;
  if (copied_rows > 0) {
    FULCRUM_CHECK(copy_source_page < num_pages_ && !std::binary_search(sorted.begin(), sorted.end(), copy_source_page),
                  "kv cache: copy source page {} outside the pool's {} pages or in the table", copy_source_page, num_pages_);
  }
  if (max_id >= num_pages_) resize_locked((max_id + kGrowPages) / kGrowPages * kGrowPages);  // growing mode only
  if (copied_rows > 0) {  // copy on write: the source page stays as it is, the copy is this sequence's own
    for (size_t layer = 0; layer < k_.size(); ++layer) {
      for (std::vector<Tensor>* pool : {&k_, &v_}) {
        const Tensor& t = (*pool)[layer];
        backend_.copy(t.rows(copy_dest_page * page_size_, copied_rows), t.rows(copy_source_page * page_size_, copied_rows));
      }
    }
  }
  mapped_ = true;
  KvCache cache;
  cache.pool_ = weak_from_this();
  FULCRUM_CHECK(!cache.pool_.expired(), "a KvPool must be owned by a std::shared_ptr");
  cache.borrowed_ = true;
  cache.capacity = capacity;
  cache.num_tokens = num_cached_tokens;
  cache.page_ids_.assign(page_ids.begin(), page_ids.end());
  return cache;
}

void KvPool::release(std::vector<int32_t>& page_ids) noexcept {
  std::lock_guard lock(mutex_);
  // Reversed, so that the next cache gets them back in the same order.
  free_.insert(free_.end(), page_ids.rbegin(), page_ids.rend());
  page_ids.clear();
}

}  // namespace fulcrum::model
