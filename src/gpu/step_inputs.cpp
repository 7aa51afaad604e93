#include "gpu/step_inputs.hpp"

namespace fulcrum::gpu {
namespace {
size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
}  // namespace

StepLayout::StepLayout(const StepCapacity& c) {
  size_t at = 0;
  const auto place = [&](size_t count, size_t elem) {
    at = align_up(at, 16);
    const size_t offset = at;
    at += count * elem;
    return offset;
  };
  const auto t = static_cast<size_t>(c.max_tokens), s = static_cast<size_t>(c.max_seqs);
  token_ids_ = place(t, 4);
  positions_ = place(t, 4);
  kv_rows_ = place(t, 4);
  q_indptr_ = place(s + 1, 4);
  kv_page_indptr_ = place(s + 1, 4);
  kv_len_ = place(s, 4);
  sample_rows_ = place(s, 4);
  sampler_ = place(s, sizeof(SamplerRow));
  page_ids_ = place(static_cast<size_t>(c.max_pages), 4);
  bytes = align_up(at, 16);
}

StepArrays StepLayout::at(void* base) const {
  auto* b = static_cast<char*>(base);
  StepArrays a;
  a.token_ids = reinterpret_cast<int32_t*>(b + token_ids_);
  a.positions = reinterpret_cast<int32_t*>(b + positions_);
  a.kv_rows = reinterpret_cast<int32_t*>(b + kv_rows_);
  a.q_indptr = reinterpret_cast<int32_t*>(b + q_indptr_);
  a.kv_page_indptr = reinterpret_cast<int32_t*>(b + kv_page_indptr_);
  a.kv_len = reinterpret_cast<int32_t*>(b + kv_len_);
  a.sample_rows = reinterpret_cast<int32_t*>(b + sample_rows_);
  a.page_ids = reinterpret_cast<int32_t*>(b + page_ids_);
  a.sampler = reinterpret_cast<SamplerRow*>(b + sampler_);
  return a;
}

}  // namespace fulcrum::gpu
