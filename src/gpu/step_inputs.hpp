#pragma once
// The per-step inputs of the GPU engine's forward, packed on the host into one pinned buffer and copied to the
// device in one transfer before the forward. Every array has a fixed offset sized by the engine's capacities,
// so a CUDA graph captured once reads each step's values from the same device addresses.
#include <cstdint>
#include <span>
#include <vector>

#include "gpu/kernels/sampler.hpp"

namespace fulcrum::gpu {

struct StepCapacity {
  int64_t max_tokens = 0;  // new tokens per step
  int max_seqs = 0;        // sequences per step
  int64_t max_pages = 0;   // pages of all the step's sequences together
};

// Device (or pinned host) addresses of the arrays, all inside one buffer.
struct StepArrays {
  int32_t* token_ids = nullptr;       // [T]
  int32_t* positions = nullptr;       // [T]
  int32_t* kv_rows = nullptr;         // [T] pool row each token's K/V goes to
  int32_t* q_indptr = nullptr;        // [S + 1]
  int32_t* kv_page_indptr = nullptr;  // [S + 1]
  int32_t* kv_len = nullptr;          // [S]
  int32_t* sample_rows = nullptr;     // [R] token row whose logits sample, per sampling entry
  int32_t* page_ids = nullptr;        // [pages]
  SamplerRow* sampler = nullptr;      // [R]
};

// Byte layout of the buffer for a capacity; `at(base)` gives the arrays of a buffer starting at base.
struct StepLayout {
  explicit StepLayout(const StepCapacity& capacity);
  StepArrays at(void* base) const;
  // Bytes from the start that a step with `num_pages` pages uses (page_ids is last, so one copy covers a step).
  size_t used_bytes(int64_t num_pages) const { return page_ids_ + static_cast<size_t>(num_pages) * 4; }
  size_t bytes = 0;

 private:
  size_t token_ids_ = 0, positions_ = 0, kv_rows_ = 0, q_indptr_ = 0, kv_page_indptr_ = 0, kv_len_ = 0,
         sample_rows_ = 0, page_ids_ = 0, sampler_ = 0;
};

// What one step holds besides the arrays (host values that size the launches).
struct StepShape {
  int64_t num_tokens = 0;
  int num_seqs = 0;
  int num_samples = 0;     // R
  int64_t num_pages = 0;
  int64_t max_kv_len = 0;  // longest kv_len of the step
  bool decode_only = false;  // every sequence has exactly one new token and samples
};

}  // namespace fulcrum::gpu
