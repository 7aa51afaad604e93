// The model on the paged KV pool (CPU): a sequence's logits are bit-identical whether its pages are
// contiguous, scattered among other sequences' pages, reused after others released them, or moved by the
// pool growing; chunked prefill across page boundaries equals one prefill; an exhausted pool refuses.
#include <random>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "model_paged_kv_util.hpp"

namespace fulcrum::test {
namespace {

using model::KvCache;
using model::SequenceInput;

class PagedKvModelTest : public ::testing::Test {
 protected:
  PagedKvModelTest()
      : config_(model::load_qwen3_moe_config(golden_model_dir("qwen3moe-tiny-128e"))), qwen_(config_, cpu_) {
    model::Checkpoint checkpoint(golden_model_dir("qwen3moe-tiny-128e"));
    qwen_.load_weights(checkpoint);
  }
  std::vector<std::vector<float>> run(KvCache& cache, const std::vector<int64_t>& chunks = {13}) {
    return run_paged_sequence(qwen_, cpu_, cache, chunks);
  }

  model::Qwen3MoeConfig config_;
  backend::CpuBackend cpu_;
  model::Qwen3MoeModel qwen_;
};

TEST(PagedKvModel, ScatteredAndReusedPagesGiveIdenticalLogits) {
  backend::CpuBackend cpu;
  expect_page_layout_does_not_change_logits(cpu);
}

TEST_F(PagedKvModelTest, ChunkedPrefillAcrossPageBoundariesEqualsOnePrefill) {
  qwen_.reserve_kv_pool(8, 4);
  KvCache whole = qwen_.create_kv_cache(16);
  const auto reference = run(whole);
  whole.release();
  KvCache chunked = qwen_.create_kv_cache(16);
  const auto steps = run(chunked, {5, 1, 7});  // positions [0, 5), 5, [6, 13): two cross a page boundary
  ASSERT_EQ(steps.size(), 6u);
  std::vector<float> prefill = steps[0];
  prefill.insert(prefill.end(), steps[1].begin(), steps[1].end());
  prefill.insert(prefill.end(), steps[2].begin(), steps[2].end());
  ASSERT_EQ(prefill.size(), kPagedPrompt.size() * static_cast<size_t>(config_.vocab_size));
  EXPECT_EQ(prefill, reference[0]);
  for (size_t step = 0; step < kPagedDecoded.size(); ++step) EXPECT_EQ(steps[3 + step], reference[1 + step]) << step;
}

TEST_F(PagedKvModelTest, GrowingPoolMovesLiveSequencesUnchanged) {
  KvCache reference_cache = qwen_.create_kv_cache(16);  // the default pool: grows on demand
  const auto reference = run(reference_cache);
  reference_cache.release();
  KvCache cache = qwen_.create_kv_cache(16);
  const SequenceInput prefill{kPagedPrompt, &cache};
  EXPECT_EQ(cpu_.download(qwen_.forward(std::span(&prefill, 1))[0]), reference[0]);
  const int64_t before = qwen_.kv_pool().num_pages();
  KvCache big = qwen_.create_kv_cache(before * qwen_.kv_pool().page_size() * 3);  // reallocates the pool
  EXPECT_GT(qwen_.kv_pool().num_pages(), before);
  for (size_t step = 0; step < kPagedDecoded.size(); ++step) {
    const SequenceInput decode{std::span(&kPagedDecoded[step], 1), &cache};
    EXPECT_EQ(cpu_.download(qwen_.forward(std::span(&decode, 1))[0]), reference[1 + step]) << step;
  }
}

// Sequences come and go on a reserved pool, admitted only while pages last (as a server would): the pool
// never reallocates, the accounting matches the live caches at every step, and everything returns.
TEST_F(PagedKvModelTest, ChurnOnAReservedPoolNeverGrowsAndLeaksNothing) {
  qwen_.reserve_kv_pool(12, 4);
  const model::KvPool& pool = qwen_.kv_pool();
  const float* k_data = pool.k(0).data();
  std::mt19937 rng(5);
  std::vector<KvCache> live;
  int num_refused = 0;
  for (int step = 0; step < 40; ++step) {
    const auto capacity = static_cast<int64_t>(1 + rng() % 15);
    try {
      live.push_back(qwen_.create_kv_cache(capacity));
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("KV pool exhausted"), std::string::npos);
      ++num_refused;
    }
    std::vector<int32_t> tokens(live.size(), static_cast<int32_t>(step));
    std::vector<SequenceInput> batch;
    for (size_t i = 0; i < live.size(); ++i) {
      if (live[i].num_tokens < live[i].capacity) batch.push_back({std::span(&tokens[i], 1), &live[i]});
    }
    qwen_.forward(batch);
    int64_t held = 0;
    for (const KvCache& cache : live) held += static_cast<int64_t>(cache.page_ids().size());
    EXPECT_EQ(pool.num_used_pages(), held) << step;
    EXPECT_EQ(pool.num_pages(), 12);
    EXPECT_EQ(pool.k(0).data(), k_data);
    if (rng() % 3 == 0 && !live.empty()) live.erase(live.begin() + static_cast<ptrdiff_t>(rng() % live.size()));
  }
  EXPECT_GT(num_refused, 0);  // the pool was full at times
  live.clear();
  EXPECT_EQ(pool.num_free_pages(), 12);
}

TEST_F(PagedKvModelTest, ExhaustedPoolAndForeignCachesAreErrors) {
  qwen_.reserve_kv_pool(4, 4);
  EXPECT_EQ(error_of([&] { qwen_.create_kv_cache(17); }), "KV pool exhausted: need 5 pages, 4 free");
  KvCache held = qwen_.create_kv_cache(5);
  EXPECT_NE(error_of([&] { qwen_.reserve_kv_pool(8, 4); }).find("2 pages are in use"), std::string::npos);
  EXPECT_EQ(qwen_.kv_pool().num_pages(), 4);

  model::Qwen3MoeModel stranger(config_, cpu_);
  KvCache foreign = stranger.create_kv_cache(8);
  const SequenceInput seq{kPagedOtherPrompt, &foreign};
  EXPECT_NE(error_of([&] { qwen_.forward(std::span(&seq, 1)); }).find("made by this stage"), std::string::npos);
  KvCache released = qwen_.create_kv_cache(8);
  released.release();
  const SequenceInput empty{kPagedOtherPrompt, &released};
  EXPECT_NE(error_of([&] { qwen_.forward(std::span(&empty, 1)); }).find("made by this stage"), std::string::npos);
}

}  // namespace
}  // namespace fulcrum::test
