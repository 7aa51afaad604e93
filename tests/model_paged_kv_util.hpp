#pragma once
// The paged-KV model scenario shared by the CPU tests (tests/model_paged_kv_test.cpp) and the CUDA tests
// (tests_cuda/cuda_paged_kv_test.cpp): one sequence run on contiguous, scattered and reused pages.
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "model/qwen3_moe.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {

inline const std::vector<int32_t> kPagedPrompt = {3, 17, 250, 9, 9, 41, 0, 128, 77, 5, 6, 200, 31};  // 13 tokens
inline const std::vector<int32_t> kPagedDecoded = {12, 99, 4};                                          // one by one
inline const std::vector<int32_t> kPagedOtherPrompt = {1, 2, 3, 4, 5, 6, 7};

// Logits of kPagedPrompt prefilled in `chunks`, then of each kPagedDecoded token: one vector per forward.
inline std::vector<std::vector<float>> run_paged_sequence(model::Qwen3MoeModel& qwen, model::Backend& backend,
                                                          model::KvCache& cache,
                                                          const std::vector<int64_t>& chunks = {13}) {
  std::vector<std::vector<float>> steps;
  int64_t done = 0;
  for (const int64_t count : chunks) {
    const model::SequenceInput chunk{std::span(kPagedPrompt).subspan(static_cast<size_t>(done), count), &cache};
    steps.push_back(backend.download(qwen.forward(std::span(&chunk, 1))[0]));
    done += count;
  }
  for (const int32_t& token : kPagedDecoded) {
    const model::SequenceInput decode{std::span(&token, 1), &cache};
    steps.push_back(backend.download(qwen.forward(std::span(&decode, 1))[0]));
  }
  return steps;
}

inline std::vector<int32_t> page_ids_of(const model::KvCache& cache) {
  return {cache.page_ids().begin(), cache.page_ids().end()};
}

// On the tiny golden model over `backend`: the logits of one sequence are bit-identical on contiguous
// pages, on pages out of order among another live sequence's, and on pages other sequences wrote and
// released. (Each pass runs one sequence, so that a GEMM of another row count cannot differ on a GPU.)
inline void expect_page_layout_does_not_change_logits(model::Backend& backend) {
  const std::string dir = golden_model_dir("qwen3moe-tiny-128e");
  model::Qwen3MoeModel qwen(model::load_qwen3_moe_config(dir), backend);
  model::Checkpoint checkpoint(dir);
  qwen.load_weights(checkpoint);
  qwen.reserve_kv_pool(24, 4);
  std::vector<std::vector<float>> reference;
  {
    model::KvCache cache = qwen.create_kv_cache(16);
    ASSERT_EQ(page_ids_of(cache), (std::vector<int32_t>{0, 1, 2, 3}));
    reference = run_paged_sequence(qwen, backend, cache);
  }
  std::vector<model::KvCache> fillers;
  for (int i = 0; i < 8; ++i) fillers.push_back(qwen.create_kv_cache(4));  // pages 0..7
  for (const int i : {1, 6, 3, 4}) fillers[static_cast<size_t>(i)].release();
  model::KvCache scattered = qwen.create_kv_cache(16);  // the last released first
  EXPECT_EQ(page_ids_of(scattered), (std::vector<int32_t>{4, 3, 6, 1}));
  model::KvCache other = qwen.create_kv_cache(10);  // pages 8, 9, 10
  const model::SequenceInput other_prefill{kPagedOtherPrompt, &other};
  qwen.forward(std::span(&other_prefill, 1));  // writes pages 8 and 9
  EXPECT_EQ(run_paged_sequence(qwen, backend, scattered), reference);

  fillers.clear();
  scattered.release();
  other.release();
  EXPECT_EQ(qwen.kv_pool().num_used_pages(), 0);
  model::KvCache reused = qwen.create_kv_cache(16);  // `other`'s pages (written), then one of `scattered`'s
  EXPECT_EQ(page_ids_of(reused), (std::vector<int32_t>{8, 9, 10, 4}));
  EXPECT_EQ(run_paged_sequence(qwen, backend, reused), reference);
}

}  // namespace fulcrum::test
