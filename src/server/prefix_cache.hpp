#pragma once
// The KV pages of one attention-DP group's pool, with prefix caching (SGLang's radix cache, vLLM's automatic
// prefix caching): sequences whose prompts begin with the same whole pages of token ids share the pages
// that hold their K/V, computed once; a match that ends inside a page gets a copy of that page's first rows.
//
// NOTES: the index is a radix tree whose edges are whole pages. A node is one page: the page_size token ids
// it holds (its key among its parent's children, compared exactly: no hash, no collision) and the page id
// whose K/V rows they wrote, given the node's path from the root as their prefix. A page's K/V depends on
// every token before it, so a node is only reachable through the pages of its own prefix.
//   - Every page is in exactly one place: the free list, a node of the tree, or private to one lease (the
//     pages of a sequence past its indexed ones: its partial last prompt page and its generated tokens).
//   - A node is pending until its owner's prefill has written it, then ready; a ready node is never written
//     again (a sequence only writes positions past its cached ones, and those are a whole number of its
//     nodes). A request whose match runs into a pending node waits (probe().blocked) rather than compute the
//     same page again; its owner is running and writes it within its prefill.
//   - refs = live leases whose path holds the node; a lease holds the whole path from the root, so a node's
//     refs are at least any child's. Unreferenced nodes (refs 0; always ready) are the cache: evicted
//     least-recently-released leaf first when the free list is short (and by flush()), never a node in use.
//   - Matches stop one token short of the prompt, so every request computes at least its last prompt token,
//     whose logits it samples from.
//   - Partial pages (copy on write): after its whole pages, a match may go on into one more page, the ready
//     child of its last node whose key shares the longest run r >= 1 of first tokens with the prompt's next
//     ones (found from where the prompt's next tokens sort among the children: the common prefix only
//     shrinks away from there). The lease gets a fresh page of its own for that position, into
//     which the engine copies the child's first r rows (model::SequencePages::copy_source_page), so
//     num_cached_tokens = whole pages * page_size + r. The child is pinned (one ref, not in the path) from
//     acquire until the lease's first step has run (on_written past num_cached_tokens) or its release.
//   - A finished sequence's pages join the tree as far as it has written whole pages (generated tokens
//     included, as a later turn of a conversation resends them); a page whose node exists already is freed.
//     Its written partial last page joins too, as a leaf whose key is shorter than page_size (only a copy
//     source: a walk over whole pages never enters it, and it has no children), unless a sibling's key
//     starts with the same tokens (that one serves every match it could).
// Counts are kept so that free + cached (in the tree) + private = num_pages at all times (check()).
// Not thread-safe: the scheduler calls it under its lock.
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <utility>
#include <vector>

namespace fulcrum::server {

class PrefixCache {
 public:
  struct Node;

  // What one live sequence holds. Move-only; give it back with release().
  struct Lease {
    std::vector<int32_t> page_ids;  // the sequence's page table, [ceil(capacity / page_size)]
    std::vector<Node*> path;        // its nodes, root first: page_ids[i] is path[i]'s page for i < path.size()
    int64_t num_cached_tokens = 0;  // positions it starts with: path's first (ready) nodes, then copied rows
    int32_t copy_source_page = -1;  // the page whose first num_cached_tokens % page_size rows it copies, or -1
    Node* copy_source = nullptr;    // that page's node while pinned
  };

  struct Probe {
    int64_t num_ready_pages = 0;    // whole pages of the prompt a lease would reuse now
    int64_t num_cached_tokens = 0;  // positions it would start with (those pages, then a partial page's rows)
    bool blocked = false;         // the next page of the prompt is pending (being prefilled by another lease)
    bool fits = false;            // the pages it would add are free or evictable now
  };

  // `enabled` false: no index, every page private (the pool without prefix caching).
  PrefixCache(int64_t num_pages, int page_size, bool enabled);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // How a sequence with `prompt` and `num_pages` pages in all would start now.
  Probe probe(std::span<const int32_t> prompt, int64_t num_pages) const;
  // Its lease: the longest ready prefix shared (whole pages, then maybe a partial page to copy), the other
  // pages taken from the free list or by evicting; its whole prompt pages not shared are indexed as pending.
  // Requires probe(...).fits && !blocked.
  Lease acquire(std::span<const int32_t> prompt, int64_t num_pages);
  // The lease's sequence holds `num_written` positions now: its pending nodes they cover become ready; past
  // num_cached_tokens, its copy source is unpinned.
  void on_written(Lease& lease, int64_t num_written);
  // The sequence is gone: `tokens` are its positions (prompt, then generated), the first `num_written` of
  // which are in its pages. Pending nodes go, its written whole pages join the index, the rest are freed.
  void release(Lease& lease, std::span<const int32_t> tokens, int64_t num_written);
  // Evicts every unreferenced page; returns how many. Pages of live leases stay.
  int64_t flush();
  // What drop_all() dropped.
  struct Dropped {
    int64_t num_prefixes = 0;  // leaves of the index: distinct cached prefixes
    int64_t num_pages = 0;     // pages in the index, in use or not
  };
  // The pool's pages were lost (elastic EP rebuilt it): the whole index goes, referenced or not, and every
  // page is free. Every lease taken before is void: its holder forgets it (Lease{}), never releases it.
  Dropped drop_all();

  bool enabled() const { return enabled_; }
  int page_size() const { return page_size_; }
  int64_t num_pages() const { return num_pages_; }
  int64_t num_free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_cached_pages() const { return num_nodes_; }              // in the tree, in use or not
  int64_t num_unreferenced_pages() const { return num_unreferenced_; }  // evictable
  int64_t num_used_pages() const { return num_pages_ - num_free_pages() - num_unreferenced_; }  // held by leases
  int64_t num_evicted_pages() const { return num_evicted_; }          // by pressure, since construction
  // Throws fulcrum::Error when an invariant of the NOTES above does not hold (tests).
  void check() const;

 private:
  using Key = std::vector<int32_t>;  // the page_size token ids of one page
  struct Match {
    std::vector<Node*> ready;  // whole pages, root first
    bool blocked = false;
    Node* partial = nullptr;   // the ready child of ready.back() (or the root) to copy rows from
    int64_t partial_rows = 0;  // in [1, page_size) when partial
  };
  Match walk(std::span<const int32_t> prompt) const;
  int32_t take_page();  // a free page, evicting the least recently used unreferenced leaf when none is
  void evict(Node* leaf);
  void unpin(Lease& lease);  // drops the lease's ref on its copy source
  void ref(Node* node);
  void unref(Node* node);
  void update_evictable(Node* node);  // (re)files node in evictable_ when it is an unreferenced leaf
  Node* add_child(Node* parent, Key key, int32_t page_id, bool ready);

  const int64_t num_pages_;
  const int page_size_;
  const bool enabled_;
  std::unique_ptr<Node> root_;  // holds no page
  std::vector<int32_t> free_;   // a stack: back() goes next (lowest ids first on a fresh pool)
  std::set<std::pair<uint64_t, Node*>> evictable_;  // unreferenced leaves by (last release, node)
  uint64_t clock_ = 0;
  int64_t num_nodes_ = 0, num_unreferenced_ = 0, num_evicted_ = 0;
};

struct PrefixCache::Node {
  Node* parent = nullptr;
  Key key;
  int32_t page_id = -1;
  bool ready = false;
  int64_t refs = 0;
  uint64_t last_use = 0;  // clock_ at its last release; its key in evictable_
  bool in_evictable = false;
  std::map<Key, std::unique_ptr<Node>> children;
};

}  // namespace fulcrum::server
