#include "gpu/device_kv_pool.hpp"

#include <algorithm>

#include "backend/cuda/cuda_check.hpp"
#include "eplb/error.hpp"

namespace fulcrum::gpu {

int64_t DeviceKvPool::bytes_for(int64_t num_pages, int page_size, int num_layers, int num_kv_heads, int head_dim) {
  return 2 * int64_t{num_layers} * num_pages * page_size * num_kv_heads * head_dim * 2;  // K and V, bf16
}

DeviceKvPool::DeviceKvPool(int64_t num_pages, int page_size, int num_layers, int num_kv_heads, int head_dim, int device_idx)
    : num_pages_(num_pages), page_size_(page_size), num_layers_(num_layers), num_kv_heads_(num_kv_heads), head_dim_(head_dim) {
  FULCRUM_CHECK(num_pages >= 1 && num_pages <= INT32_MAX / 2 && page_size >= 1, "KV pool: {} pages of {} positions",
                num_pages, page_size);
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx));
  size_t free_bytes = 0, total_bytes = 0;
  FULCRUM_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const double gib = 1024.0 * 1024.0 * 1024.0;
  FULCRUM_CHECK(bytes() <= static_cast<int64_t>(free_bytes),
                "a KV pool of {} pages x {} positions needs {:.2f} GiB on GPU {}, which has {:.2f} GiB free", num_pages,
                page_size, bytes() / gib, device_idx, free_bytes / gib);
  FULCRUM_CUDA_CHECK(cudaMalloc(&base_, static_cast<size_t>(bytes())));
  free_.reserve(static_cast<size_t>(num_pages));
  for (int64_t p = num_pages; p-- > 0;) free_.push_back(static_cast<int32_t>(p));
}

DeviceKvPool::~DeviceKvPool() {
  if (base_ != nullptr) cudaFree(base_);
}

uint16_t* DeviceKvPool::k(int layer_idx) const {
  return base_ + 2 * int64_t{layer_idx} * num_pages_ * page_size_ * num_kv_heads_ * head_dim_;
}

uint16_t* DeviceKvPool::v(int layer_idx) const {
  return k(layer_idx) + num_pages_ * page_size_ * num_kv_heads_ * head_dim_;
}

void DeviceKvPool::allocate(SequenceId id, int64_t capacity) {
  FULCRUM_CHECK(!live(id), "sequence {} is already live", id);
  FULCRUM_CHECK(capacity >= 1, "sequence {}: capacity {} must be positive", id, capacity);
  FULCRUM_CHECK(!mapped_, "KV pool: its pages are chosen by the caller (allocate_on_pages)");
  const int64_t need = (capacity + page_size_ - 1) / page_size_;
  FULCRUM_CHECK(need <= num_free_pages(), "KV pool exhausted: need {} pages, {} free", need, num_free_pages());
  KvSequence seq;
  seq.capacity = capacity;
  seq.page_ids.assign(free_.end() - need, free_.end());
  std::reverse(seq.page_ids.begin(), seq.page_ids.end());
  free_.resize(free_.size() - static_cast<size_t>(need));
  seqs_.emplace(id, std::move(seq));
}

void DeviceKvPool::allocate_on_pages(SequenceId id, int64_t capacity, std::span<const int32_t> page_ids,
                                     int64_t num_cached_tokens, int32_t copy_source_page, CUstream_st* stream) {
  FULCRUM_CHECK(!live(id), "sequence {} is already live", id);
  FULCRUM_CHECK(capacity >= 1, "sequence {}: capacity {} must be positive", id, capacity);
  FULCRUM_CHECK(num_cached_tokens >= 0 && num_cached_tokens < capacity, "sequence {}: {} cached positions of {}", id,
                num_cached_tokens, capacity);
  const int64_t need = (capacity + page_size_ - 1) / page_size_;
  FULCRUM_CHECK(static_cast<int64_t>(page_ids.size()) == need, "sequence {}: {} page ids for {} positions, need {}", id,
                page_ids.size(), capacity, need);
  FULCRUM_CHECK(mapped_ || num_free_pages() == num_pages_, "KV pool: {} pages are in sequences it allocated itself",
                num_pages_ - num_free_pages());
  std::vector<int32_t> sorted(page_ids.begin(), page_ids.end());
  std::sort(sorted.begin(), sorted.end());
  FULCRUM_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "sequence {}: a page id twice", id);
  FULCRUM_CHECK(sorted.front() >= 0 && sorted.back() < num_pages_, "sequence {}: page ids outside [0, {})", id, num_pages_);
  const int64_t copied_rows = num_cached_tokens % page_size_;
  FULCRUM_CHECK((copied_rows > 0) == (copy_source_page >= 0),
                "sequence {}: {} cached positions of pages of {} with copy source page {}", id, num_cached_tokens,
                page_size_, copy_source_page);
  if (copied_rows > 0) {  // copy on write: the source page stays as it is, the copy is this sequence's own
    FULCRUM_CHECK(copy_source_page < num_pages_ && !std::binary_search(sorted.begin(), sorted.end(), copy_source_page),
                  "sequence {}: copy source page {} outside [0, {}) or in its table", id, copy_source_page, num_pages_);
    const int64_t row = int64_t{num_kv_heads_} * head_dim_;  // bf16 elements
    const int64_t dst = page_ids[static_cast<size_t>(num_cached_tokens / page_size_)] * int64_t{page_size_} * row;
    const int64_t src = copy_source_page * int64_t{page_size_} * row;
    const size_t bytes = static_cast<size_t>(copied_rows * row) * sizeof(uint16_t);
    for (int l = 0; l < num_layers_; ++l) {
      for (uint16_t* pool : {k(l), v(l)}) {
        FULCRUM_CUDA_CHECK(cudaMemcpyAsync(pool + dst, pool + src, bytes, cudaMemcpyDeviceToDevice, stream));
      }
    }
  }
  mapped_ = true;
  KvSequence seq;
  seq.capacity = capacity;
  seq.num_tokens = num_cached_tokens;
  seq.page_ids.assign(page_ids.begin(), page_ids.end());
  seq.borrowed = true;
  seqs_.emplace(id, std::move(seq));
}

void DeviceKvPool::release(SequenceId id) {
  const auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  if (!it->second.borrowed) free_.insert(free_.end(), it->second.page_ids.rbegin(), it->second.page_ids.rend());
  seqs_.erase(it);
}

KvSequence& DeviceKvPool::sequence(SequenceId id) {
  const auto it = seqs_.find(id);
  FULCRUM_CHECK(it != seqs_.end(), "sequence {} is not live", id);
  return it->second;
}

}  // namespace fulcrum::gpu
