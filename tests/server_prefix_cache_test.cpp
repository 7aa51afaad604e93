// Prefix caching: the page index alone (sharing, pending pages, partial pages copied on write, LRU eviction,
// reference counts under random operations), then through the scheduler over the paged fake executor (greedy outputs with and without the
// cache, a prefix still being prefilled, eviction under a small pool, cancellation, attention-DP groups).
#include <algorithm>
#include <map>

#include <gtest/gtest.h>

#include "model/rng.hpp"
#include "server/prefix_cache.hpp"
#include "server/scheduler.hpp"
#include "server_test_util.hpp"

namespace fulcrum::server {
namespace {

using test::FakeExecutor;

std::vector<int32_t> tokens(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

std::vector<int32_t> random_tokens(model::Rng& rng, int n, int vocab = 50) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(static_cast<int32_t>(rng.next() % static_cast<uint64_t>(vocab)));
  return out;
}

TEST(ServerPrefixCache, SharesWholeReadyPagesAndComputesTheLastToken) {
  PrefixCache cache(16, 4, true);
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // 2 whole pages + 2 tokens
  PrefixCache::Lease la = cache.acquire(a, 4);
  EXPECT_EQ(la.num_cached_tokens, 0);
  EXPECT_EQ(la.path.size(), 2u);  // its whole prompt pages, pending
  EXPECT_EQ(cache.num_cached_pages(), 2);
  // While pending, a request with the same prefix waits instead of computing the pages again.
  EXPECT_TRUE(cache.probe(a, 4).blocked);
  cache.on_written(la, 5);  // page 0 written
  PrefixCache::Probe p = cache.probe(a, 4);
  EXPECT_TRUE(p.blocked);
  EXPECT_EQ(p.num_ready_pages, 1);
  cache.on_written(la, 10);
  p = cache.probe(a, 4);
  EXPECT_FALSE(p.blocked);
  EXPECT_EQ(p.num_ready_pages, 2);

  PrefixCache::Lease lb = cache.acquire(a, 4);
  EXPECT_EQ(lb.num_cached_tokens, 8);
  EXPECT_EQ(std::vector<int32_t>(lb.page_ids.begin(), lb.page_ids.begin() + 2),
            std::vector<int32_t>(la.page_ids.begin(), la.page_ids.begin() + 2));
  EXPECT_NE(lb.page_ids[2], la.page_ids[2]);  // the partial page is each sequence's own
  // Shared pages count once: 4 + 2 pages in use.
  EXPECT_EQ(cache.num_used_pages(), 6);
  // A prompt of exactly 2 pages reuses 1: its last token must be computed.
  EXPECT_EQ(cache.probe(std::vector<int32_t>(a.begin(), a.begin() + 8), 2).num_ready_pages, 1);
  // A prompt that differs inside page 1 reuses page 0 whole and page 1's first 2 rows (copied).
  p = cache.probe(tokens({{1, 2, 3, 4, 5, 6, 0, 8, 9, 10}}), 4);
  EXPECT_EQ(p.num_ready_pages, 1);
  EXPECT_EQ(p.num_cached_tokens, 6);
  cache.check();

  cache.release(lb, a, 10);
  cache.release(la, a, 10);  // its partial page [9 10] is lb's, indexed first: la's goes
  cache.check();
  EXPECT_EQ(cache.num_used_pages(), 0);
  EXPECT_EQ(cache.num_cached_pages(), 3);  // 2 whole pages and lb's partial leaf
  EXPECT_EQ(cache.flush(), 3);
  EXPECT_EQ(cache.num_free_pages(), 16);
  cache.check();
}

// A match that ends inside a page: the lease gets a fresh page to copy the cached page's first rows into,
// the cached page pinned (not evictable) until the lease's first step, then unreferenced again; a finished
// sequence's partial last page is a copy source too.
TEST(ServerPrefixCache, PartialPagesAreCopiedIntoAFreshPageAndPinnedUntilTheFirstStep) {
  PrefixCache cache(8, 4, true);
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // [1 2 3 4] [5 6 7 8] [9 10]
  PrefixCache::Lease la = cache.acquire(a, 3);
  cache.on_written(la, 10);
  const std::vector<int32_t> pages_a = la.page_ids;  // (release empties the lease)
  const std::vector<int32_t> b = {1, 2, 3, 4, 5, 6, 0, 0, 0};  // page 0 whole, then [5 6] of a's page 1
  PrefixCache::Lease lb = cache.acquire(b, 3);
  EXPECT_EQ(lb.num_cached_tokens, 6);
  EXPECT_EQ(lb.copy_source_page, la.page_ids[1]);
  EXPECT_EQ(lb.page_ids[0], la.page_ids[0]);
  EXPECT_NE(lb.page_ids[1], la.page_ids[1]);  // its own page: the copy's destination
  ASSERT_EQ(lb.path.size(), 2u);              // page 0, then its own [5 6 0 0], pending
  EXPECT_FALSE(lb.path[1]->ready);
  // The match stops one token short of the prompt, inside a page too.
  const PrefixCache::Probe short_probe = cache.probe(std::vector<int32_t>(a.begin(), a.begin() + 8), 2);
  EXPECT_EQ(short_probe.num_ready_pages, 1);
  EXPECT_EQ(short_probe.num_cached_tokens, 7);
  cache.release(la, a, 10);  // its page 1 stays pinned by b; its written [9 10] joins as a partial leaf
  cache.check();
  EXPECT_EQ(cache.num_cached_pages(), 4);
  EXPECT_EQ(cache.num_unreferenced_pages(), 1);  // the partial leaf only

  // The partial leaf serves a prompt that goes on past it.
  const std::vector<int32_t> d = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  PrefixCache::Lease ld = cache.acquire(d, 3);
  EXPECT_EQ(ld.num_cached_tokens, 10);
  EXPECT_EQ(ld.copy_source_page, pages_a[2]);
  cache.release(ld, d, 0);  // cancelled before its first step: the pin goes, nothing indexed
  cache.check();
  EXPECT_EQ(cache.num_unreferenced_pages(), 1);

  // Pressure: 3 pages free and the partial leaf evictable; a's page 1 is pinned, so 5 new pages do not fit.
  const std::vector<int32_t> c = {20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32};
  EXPECT_FALSE(cache.probe(c, 5).fits);
  PrefixCache::Lease lc = cache.acquire(c, 4);
  EXPECT_EQ(cache.num_evicted_pages(), 1);
  EXPECT_EQ(cache.num_unreferenced_pages(), 0);
  cache.on_written(lb, 6);  // nothing computed yet: still pinned
  EXPECT_EQ(cache.num_unreferenced_pages(), 0);
  cache.on_written(lb, 7);  // its first step ran: the copy is done
  EXPECT_EQ(cache.num_unreferenced_pages(), 1);
  cache.check();
  cache.release(lc, c, 0);
  cache.release(lb, b, 9);
  cache.check();
  EXPECT_EQ(cache.num_used_pages(), 0);
  cache.flush();
  EXPECT_EQ(cache.num_free_pages(), 8);
  EXPECT_EQ(cache.num_cached_pages(), 0);
}

TEST(ServerPrefixCache, FinishedSequencesIndexTheirWrittenPagesGeneratedOnesIncluded) {
  PrefixCache cache(16, 4, true);
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6};
  PrefixCache::Lease l = cache.acquire(prompt, 4);  // prompt 6 + 10 new tokens
  cache.on_written(l, 6);
  const std::vector<int32_t> history = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};  // 5 generated, 4 of them fed
  cache.release(l, history, 10);
  cache.check();
  // Positions [0, 8) in 2 whole pages; page 2 holds 2 written positions: a partial leaf.
  EXPECT_EQ(cache.num_cached_pages(), 3);
  // A next turn that resends the conversation reuses both pages and copies the partial one's 2 rows.
  const PrefixCache::Probe p = cache.probe(tokens({history, {12, 13}}), 4);
  EXPECT_EQ(p.num_ready_pages, 2);
  EXPECT_EQ(p.num_cached_tokens, 10);
}

TEST(ServerPrefixCache, EvictsLeastRecentlyUsedUnreferencedLeavesOnly) {
  PrefixCache cache(6, 2, true);
  const std::vector<int32_t> a = {1, 1, 2, 2, 3}, b = {4, 4, 5, 5, 6}, c = {7, 7, 8, 8, 9};
  PrefixCache::Lease la = cache.acquire(a, 3), lb = cache.acquire(b, 3);
  // Released with their last prompt token not fed (whole pages only, no partial leaf); a first: least
  // recently used.
  cache.release(la, a, 4);
  cache.release(lb, b, 4);
  EXPECT_EQ(cache.num_cached_pages(), 4);
  EXPECT_EQ(cache.num_free_pages(), 2);
  // c needs 3 pages: 2 free, then a's leaf (page 2 of a) goes.
  ASSERT_TRUE(cache.probe(c, 3).fits);
  PrefixCache::Lease lc = cache.acquire(c, 3);
  EXPECT_EQ(cache.num_evicted_pages(), 1);
  EXPECT_EQ(cache.probe(a, 3).num_ready_pages, 1);
  EXPECT_EQ(cache.probe(b, 3).num_ready_pages, 2);
  // b in use again: the last unreferenced page (a's page 0) makes its room; then nothing is evictable, as
  // every page left is in use.
  PrefixCache::Lease lb2 = cache.acquire(b, 3);
  EXPECT_EQ(lb2.num_cached_tokens, 4);
  EXPECT_EQ(cache.num_evicted_pages(), 2);
  EXPECT_EQ(cache.probe(a, 3).num_ready_pages, 0);
  EXPECT_EQ(cache.num_unreferenced_pages(), 0);
  EXPECT_FALSE(cache.probe(tokens({{9, 9, 9}}), 1).fits);
  cache.check();
  cache.release(lc, c, 0);  // cancelled before any write: its pending pages go, nothing indexed
  cache.release(lb2, b, 4);
  cache.check();
  EXPECT_EQ(cache.num_cached_pages(), 2);
  EXPECT_EQ(cache.flush(), 2);
  EXPECT_EQ(cache.num_free_pages(), 6);
}

// Random acquire / progress / release (at any point: cancellation mid-prefill and mid-decode) / flush on
// prompts drawn from a few shared prefixes (of any length, so matches end inside pages, and one a cut of
// another), the invariants checked after every operation; at the end every page is back. A shadow pool of
// token ids plays the engine: acquire copies the partial page's rows, writes go to a lease's own pages only
// (never to a slot written before), and every lease reads back its own tokens through its page table.
TEST(ServerPrefixCache, ReferenceCountsUnderRandomOperations) {
  for (const bool enabled : {true, false}) {
    model::Rng rng(enabled ? 17 : 18);
    constexpr int kPageSize = 4;
    PrefixCache cache(40, kPageSize, enabled);
    std::vector<std::vector<int32_t>> prefixes;
    for (int i = 0; i < 3; ++i) prefixes.push_back(random_tokens(rng, 4 + static_cast<int>(rng.next() % 13), 5));
    prefixes.push_back(tokens({std::vector<int32_t>(prefixes[0].begin(), prefixes[0].begin() + 3), {9, 9}}));
    std::vector<std::vector<int32_t>> pool(40, std::vector<int32_t>(kPageSize, -1));  // shadow K/V: token ids
    const auto slot = [&](const PrefixCache::Lease& lease, int64_t pos) -> int32_t& {
      return pool[static_cast<size_t>(lease.page_ids[static_cast<size_t>(pos / kPageSize)])][static_cast<size_t>(pos % kPageSize)];
    };
    struct Live {
      std::vector<int32_t> history;  // prompt and everything it may generate
      int64_t prompt = 0, written = 0;
      PrefixCache::Lease lease;
    };
    std::vector<Live> live;
    int64_t hits = 0, partial_hits = 0;
    for (int op = 0; op < 4000; ++op) {
      const uint64_t what = rng.next() % 10;
      if (what < 4) {
        Live l;
        const std::vector<int32_t>& prefix = prefixes[rng.next() % prefixes.size()];
        l.history = tokens({prefix, random_tokens(rng, 1 + static_cast<int>(rng.next() % 6), 3)});
        l.prompt = static_cast<int64_t>(l.history.size());
        const int max_tokens = 1 + static_cast<int>(rng.next() % 8);
        const std::vector<int32_t> more = random_tokens(rng, max_tokens, 3);
        l.history.insert(l.history.end(), more.begin(), more.end());
        const int64_t pages = (l.prompt + max_tokens + kPageSize - 1) / kPageSize;
        const std::span<const int32_t> prompt(l.history.data(), static_cast<size_t>(l.prompt));
        const PrefixCache::Probe p = cache.probe(prompt, pages);
        if (!p.fits || p.blocked) continue;
        l.lease = cache.acquire(prompt, pages);
        ASSERT_EQ(l.lease.num_cached_tokens, p.num_cached_tokens);
        ASSERT_EQ(l.lease.copy_source_page >= 0, p.num_cached_tokens % kPageSize != 0);
        partial_hits += p.num_cached_tokens % kPageSize;
        hits += l.lease.num_cached_tokens;
        l.written = l.lease.num_cached_tokens;
        const int64_t whole = l.written / kPageSize;
        for (size_t i = static_cast<size_t>(whole); i < l.lease.page_ids.size(); ++i) pool[static_cast<size_t>(l.lease.page_ids[i])].assign(kPageSize, -1);
        if (l.lease.copy_source_page >= 0) {
          std::copy_n(pool[static_cast<size_t>(l.lease.copy_source_page)].begin(), l.written % kPageSize,
                      pool[static_cast<size_t>(l.lease.page_ids[static_cast<size_t>(whole)])].begin());
        }
        for (int64_t pos = 0; pos < l.written; ++pos) ASSERT_EQ(slot(l.lease, pos), l.history[static_cast<size_t>(pos)]) << "op " << op;
        live.push_back(std::move(l));
      } else if (what < 8 && !live.empty()) {
        Live& l = live[rng.next() % live.size()];
        const int64_t room = static_cast<int64_t>(l.history.size()) - 1 - l.written;  // the last token is never fed
        const int64_t from = l.written;
        if (room > 0) l.written += 1 + static_cast<int64_t>(rng.next() % static_cast<uint64_t>(room));
        for (int64_t pos = from; pos < l.written; ++pos) {
          ASSERT_EQ(slot(l.lease, pos), -1) << "op " << op << ": a slot written twice";
          slot(l.lease, pos) = l.history[static_cast<size_t>(pos)];
        }
        cache.on_written(l.lease, l.written);
      } else if (what < 9 && !live.empty()) {
        const size_t i = rng.next() % live.size();
        for (int64_t pos = 0; pos < live[i].written; ++pos) {
          ASSERT_EQ(slot(live[i].lease, pos), live[i].history[static_cast<size_t>(pos)]) << "op " << op;
        }
        cache.release(live[i].lease, live[i].history, live[i].written);
        live.erase(live.begin() + static_cast<ptrdiff_t>(i));
      } else if (rng.next() % 8 == 0) {
        cache.flush();
      }
      ASSERT_NO_THROW(cache.check()) << "op " << op;
    }
    EXPECT_EQ(hits > 0, enabled);
    EXPECT_EQ(partial_hits > 0, enabled);
    for (Live& l : live) cache.release(l.lease, l.history, l.written);
    cache.check();
    EXPECT_EQ(cache.num_used_pages(), 0);
    cache.flush();
    EXPECT_EQ(cache.num_free_pages(), cache.num_pages()) << "enabled " << enabled;
    EXPECT_EQ(cache.num_cached_pages(), 0);
  }
}

// --- Through the scheduler, on the paged fake (which throws on a page written twice). ---

RequestParams request(std::vector<int32_t> prompt, int max_tokens) {
  RequestParams p;
  p.prompt = std::move(prompt);
  p.max_tokens = max_tokens;
  return p;
}

void run_until_idle(Scheduler& s, int max_steps = 100000) {
  for (int i = 0; i < max_steps && !s.idle(); ++i) s.step();
  ASSERT_TRUE(s.idle());
}

struct Workload {
  std::vector<RequestParams> requests;
  std::vector<int> arrival_step;  // submitted before this scheduler step
};

Workload shared_prefix_workload(uint64_t seed, int num_requests) {
  model::Rng rng(seed);
  std::vector<std::vector<int32_t>> prefixes;
  for (int i = 0; i < 3; ++i) prefixes.push_back(random_tokens(rng, 5 + static_cast<int>(rng.next() % 30)));
  // One more that leaves prefix 0 inside a page, so matches end there and copy that page's first rows.
  const size_t cut = std::min<size_t>(prefixes[0].size() - 1, 4 * (prefixes[0].size() / 8) + 2);
  prefixes.push_back(tokens({std::vector<int32_t>(prefixes[0].begin(), prefixes[0].begin() + static_cast<ptrdiff_t>(cut)),
                             random_tokens(rng, 6)}));
  Workload w;
  int step = 0;
  for (int i = 0; i < num_requests; ++i) {
    std::vector<int32_t> prompt = prefixes[rng.next() % prefixes.size()];
    const std::vector<int32_t> suffix = random_tokens(rng, static_cast<int>(rng.next() % 9));
    prompt.insert(prompt.end(), suffix.begin(), suffix.end());
    w.requests.push_back(request(prompt, 1 + static_cast<int>(rng.next() % 12)));
    step += static_cast<int>(rng.next() % 3);  // bursts and gaps
    w.arrival_step.push_back(step);
  }
  return w;
}

struct Outcome {
  std::vector<std::vector<int32_t>> outputs;
  int64_t written = 0;  // KV positions computed
  int64_t copied = 0;   // KV positions copied from a partly shared page
  QueueGauges gauges;
};

Outcome run_workload(const Workload& w, SchedulerOptions options, int num_groups = 1) {
  FakeExecutor exec;
  exec.num_groups = num_groups;
  Scheduler s(exec, options);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  size_t next = 0;
  for (int step = 0; next < w.requests.size() || !s.idle(); ++step) {
    while (next < w.requests.size() && w.arrival_step[next] <= step) handles.push_back(s.submit(w.requests[next++]));
    s.step();
  }
  Outcome out;
  for (auto& h : handles) {
    EXPECT_EQ(h->finish_reason(), FinishReason::kLength);
    out.outputs.push_back(h->wait_finished());
  }
  out.written = exec.num_written_positions;
  out.copied = exec.num_copied_positions;
  out.gauges = s.gauges();
  EXPECT_EQ(out.gauges.kv_pages_used, 0);
  EXPECT_TRUE(exec.live.empty());
  s.flush_cache();
  EXPECT_EQ(s.gauges().prefix_cache_pages, 0);
  return out;
}

TEST(ServerPrefixCache, SchedulerOutputsEqualWithAndWithoutTheCache) {
  for (const uint64_t seed : {1, 2, 3}) {
    const Workload w = shared_prefix_workload(seed, 40);
    SchedulerOptions on{.max_running_requests = 6, .kv_pages = 40, .page_size = 4, .max_prefill_tokens = 7};
    SchedulerOptions off = on;
    off.prefix_cache = false;
    const Outcome with = run_workload(w, on), without = run_workload(w, off);
    for (size_t i = 0; i < w.requests.size(); ++i) {
      EXPECT_EQ(with.outputs[i], FakeExecutor::expected(w.requests[i].prompt, w.requests[i].max_tokens, 50))
          << "seed " << seed << " request " << i;
    }
    EXPECT_EQ(with.outputs, without.outputs) << "seed " << seed;
    // The cache was used, and every cached token is one not computed.
    EXPECT_GT(with.gauges.prefix_cache_hit_tokens, 0) << "seed " << seed;
    EXPECT_EQ(without.gauges.prefix_cache_hit_tokens, 0);
    EXPECT_EQ(with.written + with.gauges.prefix_cache_hit_tokens, without.written) << "seed " << seed;
    EXPECT_GT(with.copied, 0) << "seed " << seed;  // some matches ended inside a page
    EXPECT_EQ(without.copied, 0);
  }
}

// Elastic EP's recovery (the executor's pools rebuilt empty: WorldReformed) during a step and during an
// admission, in a shared-prefix workload over two groups, some requests sampling: every group's cache is
// dropped whole, every running request runs again from its tokens (the fake refuses a cached page not
// written since), and each output is the one of the run without a recovery; the cache refills.
TEST(ServerPrefixCache, AWorldReformedDropsTheCacheAndEveryRequestRunsAgain) {
  for (const uint64_t seed : {1, 2, 3}) {
    Workload w = shared_prefix_workload(seed, 40);
    for (size_t i = 0; i < w.requests.size(); i += 3) {
      w.requests[i].sampling.temperature = 0.8f;
      w.requests[i].seed = 100 + i;
    }
    const SchedulerOptions options{.max_running_requests = 6, .kv_pages = 40, .page_size = 4, .max_prefill_tokens = 7};
    const auto run = [&](bool reform, QueueGauges& after_reform) {
      FakeExecutor exec;
      exec.num_groups = 2;
      Scheduler s(exec, options);
      std::vector<std::shared_ptr<RequestHandle>> handles;
      size_t next = 0;
      for (int step = 0; next < w.requests.size() || !s.idle(); ++step) {
        while (next < w.requests.size() && w.arrival_step[next] <= step) handles.push_back(s.submit(w.requests[next++]));
        if (reform && step == 15) exec.reform_next_step = true;
        if (reform && step == 30) exec.reform_next_allocate = true;
        if (step > 10000) {  // a cache that kept references to lost pages admits nothing again
          ADD_FAILURE() << "seed " << seed << ": no progress after " << step << " steps";
          break;
        }
        const int reforms = exec.num_reforms;
        s.step();
        if (exec.num_reforms != reforms && reforms == 0) {
          after_reform = s.gauges();
          EXPECT_EQ(after_reform.prefix_cache_pages, 0);
          EXPECT_EQ(after_reform.kv_pages_used, 0);
          EXPECT_EQ(after_reform.running, 0);
          EXPECT_GT(after_reform.waiting, 0);
        }
      }
      EXPECT_EQ(exec.num_reforms, reform ? 2 : 0);
      std::vector<std::vector<int32_t>> outputs;
      for (auto& h : handles) {
        EXPECT_EQ(h->finish_reason(), FinishReason::kLength);
        outputs.push_back(h->wait_finished());
      }
      const QueueGauges end = s.gauges();
      if (reform) {
        EXPECT_GT(end.prefix_cache_dropped_pages, 0);
        EXPECT_GT(end.prefix_cache_hit_tokens, after_reform.prefix_cache_hit_tokens);  // refilled
        EXPECT_GT(end.prefix_cache_pages, 0);
      } else {
        EXPECT_EQ(end.prefix_cache_dropped_pages, 0);
      }
      return outputs;
    };
    QueueGauges unused, after;
    const std::vector<std::vector<int32_t>> without = run(false, unused), with = run(true, after);
    EXPECT_EQ(with, without) << "seed " << seed;
    for (size_t i = 1; i < w.requests.size(); i += 3) {
      EXPECT_EQ(with[i], FakeExecutor::expected(w.requests[i].prompt, w.requests[i].max_tokens, 50)) << "seed " << seed;
    }
  }
}

TEST(ServerPrefixCache, DropAllFreesEveryPageAndVoidsLeases) {
  PrefixCache cache(16, 4, true);
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, b = {1, 2, 3, 4, 9, 9, 9, 9, 9};
  PrefixCache::Lease la = cache.acquire(a, 4);
  cache.on_written(la, 10);
  PrefixCache::Lease lb = cache.acquire(b, 3);  // shares page 0
  cache.release(la, a, 10);                   // its pages join the index; lb still holds page 0
  EXPECT_GT(cache.num_cached_pages(), 2);
  const int64_t evicted = cache.num_evicted_pages();
  const PrefixCache::Dropped dropped = cache.drop_all();
  EXPECT_EQ(dropped.num_pages, 4);     // a's 2 whole pages and partial leaf, b's pending page 1
  EXPECT_EQ(dropped.num_prefixes, 2);  // leaves: a's partial page, b's page 1
  lb = PrefixCache::Lease{};
  EXPECT_EQ(cache.num_free_pages(), 16);
  EXPECT_EQ(cache.num_cached_pages(), 0);
  EXPECT_EQ(cache.num_used_pages(), 0);
  EXPECT_EQ(cache.num_evicted_pages(), evicted);  // a counter: not reset
  cache.check();
  EXPECT_EQ(cache.probe(a, 4).num_cached_tokens, 0);
  PrefixCache::Lease again = cache.acquire(a, 4);
  EXPECT_EQ(again.num_cached_tokens, 0);
  cache.check();
}

// The gsm8k pattern at a small scale: a 42-token prefix (10 pages of 4 and 2 tokens) and 4-token questions,
// eight at once. The first computes the prefix; each other one shares its 10 whole pages, copies the 2 rows
// of the prefix's partial page out of the first request's page 10 and computes its question only.
TEST(ServerPrefixCache, APrefixEndingInsideAPageIsComputedOnce) {
  model::Rng rng(8);
  const std::vector<int32_t> prefix = random_tokens(rng, 42);
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 64});
  std::vector<std::shared_ptr<RequestHandle>> handles;
  std::vector<RequestParams> requests;
  int64_t prompt_tokens = 0;
  for (int i = 0; i < 8; ++i) {
    std::vector<int32_t> question = random_tokens(rng, 4);
    question[0] = i;  // every question differs from the others in its first token
    requests.push_back(request(tokens({prefix, question}), 3));
    prompt_tokens += static_cast<int64_t>(requests.back().prompt.size());
    handles.push_back(s.submit(requests.back()));
  }
  run_until_idle(s);
  for (size_t i = 0; i < handles.size(); ++i) {
    EXPECT_EQ(handles[i]->wait_finished(), FakeExecutor::expected(requests[i].prompt, 3, 50)) << i;
  }
  EXPECT_EQ(s.gauges().prefix_cache_hit_tokens, 7 * 42);
  EXPECT_EQ(exec.num_copied_positions, 7 * 2);
  EXPECT_EQ(exec.num_written_positions, prompt_tokens - 7 * 42 + 8 * 2);  // + 2 decode steps each
}

// Eight requests with one 40-token prefix arrive at once, prefilled 8 tokens per step: the first computes
// the prefix, the others wait for its pages (the fake throws on a page written twice) and compute only
// their own suffixes.
TEST(ServerPrefixCache, RequestsSharingAPrefixBeingPrefilledComputeItOnce) {
  model::Rng rng(5);
  const std::vector<int32_t> prefix = random_tokens(rng, 40);
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 100, .page_size = 4, .max_prefill_tokens = 8});
  std::vector<std::shared_ptr<RequestHandle>> handles;
  std::vector<RequestParams> requests;
  int64_t prompt_tokens = 0;
  for (int i = 0; i < 8; ++i) {
    requests.push_back(request(tokens({prefix, random_tokens(rng, 1 + i)}), 3));
    prompt_tokens += static_cast<int64_t>(requests.back().prompt.size());
    handles.push_back(s.submit(requests.back()));
  }
  s.step();
  EXPECT_EQ(s.gauges().running, 1);  // the others wait for the prefix's pages
  EXPECT_EQ(s.gauges().waiting, 7);
  run_until_idle(s);
  for (size_t i = 0; i < handles.size(); ++i) {
    EXPECT_EQ(handles[i]->wait_finished(), FakeExecutor::expected(requests[i].prompt, 3, 50)) << i;
  }
  EXPECT_EQ(s.gauges().prefix_cache_hit_tokens, 7 * 40);
  EXPECT_EQ(exec.num_written_positions, prompt_tokens - 7 * 40 + 8 * 2);  // + 2 decode steps each
}

// A pool too small to keep every prefix: cached pages are evicted (never one in use) and outputs stay right.
TEST(ServerPrefixCache, EvictionUnderASmallPool) {
  const Workload w = shared_prefix_workload(9, 60);
  const Outcome out = run_workload(w, {.max_running_requests = 3, .kv_pages = 24, .page_size = 4, .max_prefill_tokens = 16});
  for (size_t i = 0; i < w.requests.size(); ++i) {
    EXPECT_EQ(out.outputs[i], FakeExecutor::expected(w.requests[i].prompt, w.requests[i].max_tokens, 50)) << i;
  }
  EXPECT_GT(out.gauges.prefix_cache_evicted_pages, 0);
  EXPECT_GT(out.gauges.prefix_cache_hit_tokens, 0);
}

// Admission counts only the pages a request adds: with the prefix cached, two requests fit a pool that
// holds one of them and a half.
TEST(ServerPrefixCache, AdmissionCountsOnlyAddedPages) {
  model::Rng rng(6);
  const std::vector<int32_t> prefix = random_tokens(rng, 24);  // 6 pages
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 12, .page_size = 4, .max_prefill_tokens = 64});
  auto first = s.submit(request(tokens({prefix, {1}}), 3));  // 7 pages
  run_until_idle(s);
  auto a = s.submit(request(tokens({prefix, {2}}), 3));  // 7 pages, 6 shared
  auto b = s.submit(request(tokens({prefix, {3}}), 3));
  s.step();
  EXPECT_EQ(s.gauges().running, 2);
  EXPECT_EQ(s.gauges().kv_pages_used, 8);
  run_until_idle(s);
  EXPECT_EQ(a->wait_finished(), FakeExecutor::expected(tokens({prefix, {2}}), 3, 50));
  EXPECT_EQ(b->wait_finished(), FakeExecutor::expected(tokens({prefix, {3}}), 3, 50));
}

// Cancelling a request that holds shared pages leaves them to the others; cancelling the owner of pages still
// being prefilled lets a waiting request compute them itself. Every page is back after the flush.
TEST(ServerPrefixCache, CancellationOfRequestsHoldingSharedPages) {
  model::Rng rng(7);
  const std::vector<int32_t> prefix = random_tokens(rng, 16);
  FakeExecutor exec;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 40, .page_size = 4, .max_prefill_tokens = 4});
  const std::vector<int32_t> pa = tokens({prefix, {1, 2}}), pb = tokens({prefix, {3}}), pc = tokens({prefix, {4, 5, 6}});
  auto owner = s.submit(request(pa, 8));
  s.step();  // owner computes 4 of its 18 prompt tokens; b and c wait for the prefix
  auto b = s.submit(request(pb, 8));
  auto c = s.submit(request(pc, 8));
  s.step();
  EXPECT_EQ(s.gauges().running, 1);
  owner->cancel();  // its pending pages go; b then computes the prefix
  s.step();
  EXPECT_EQ(owner->finish_reason(), FinishReason::kCancelled);
  // b computes pages 2 and 3 (8 tokens a 4 a step), c waits for them, then both finish their prompts.
  for (int i = 0; i < 3; ++i) s.step();
  EXPECT_EQ(s.gauges().running, 2);
  b->cancel();  // holds pages c reads
  run_until_idle(s);
  EXPECT_EQ(b->finish_reason(), FinishReason::kCancelled);
  EXPECT_EQ(c->wait_finished(), FakeExecutor::expected(pc, 8, 50));
  EXPECT_EQ(s.gauges().prefix_cache_hit_tokens, 8 + 16);  // b read the owner's 2 pages, c all 4
  EXPECT_EQ(s.gauges().kv_pages_used, 0);
  EXPECT_GT(s.gauges().prefix_cache_pages, 0);
  const FlushResult flushed = s.flush_cache();
  EXPECT_EQ(flushed.in_use_pages, 0);
  EXPECT_GT(flushed.flushed_pages, 0);
  EXPECT_EQ(s.gauges().prefix_cache_pages, 0);
}

// Attention-DP groups: each has its own pool and cache; a request joins the group holding its prefix, so
// prompts of two prefixes settle in two groups, and outputs equal the run without the cache.
TEST(ServerPrefixCache, DataParallelGroupsEachCacheTheirOwnSequences) {
  const Workload w = shared_prefix_workload(11, 40);
  SchedulerOptions on{.max_running_requests = 6, .kv_pages = 30, .page_size = 4, .max_prefill_tokens = 9};
  SchedulerOptions off = on;
  off.prefix_cache = false;
  const Outcome with = run_workload(w, on, 2), without = run_workload(w, off, 2);
  EXPECT_EQ(with.outputs, without.outputs);
  for (size_t i = 0; i < w.requests.size(); ++i) {
    EXPECT_EQ(with.outputs[i], FakeExecutor::expected(w.requests[i].prompt, w.requests[i].max_tokens, 50)) << i;
  }
  EXPECT_GT(with.gauges.prefix_cache_hit_tokens, 0);
  EXPECT_EQ(with.gauges.kv_pages_total, 60);

  // The group with the longest match wins over the one with fewer requests.
  model::Rng rng(12);
  const std::vector<int32_t> prefix = random_tokens(rng, 12);
  FakeExecutor exec;
  exec.num_groups = 2;
  Scheduler s(exec, {.max_running_requests = 8, .kv_pages = 30, .page_size = 4, .max_prefill_tokens = 64});
  auto first = s.submit(request(tokens({prefix, {1}}), 20));
  s.step();
  auto other = s.submit(request(random_tokens(rng, 9), 20));  // no match: the empty group
  s.step();
  auto sharer = s.submit(request(tokens({prefix, {2}}), 2));  // group 0 holds its prefix (and 1 more request)
  s.step();
  EXPECT_EQ(exec.group_of.at(first->id()), 0);
  EXPECT_EQ(exec.group_of.at(other->id()), 1);
  EXPECT_EQ(exec.group_of.at(sharer->id()), 0);
  run_until_idle(s);
  EXPECT_EQ(sharer->wait_finished(), FakeExecutor::expected(tokens({prefix, {2}}), 2, 50));
}

}  // namespace
}  // namespace fulcrum::server
