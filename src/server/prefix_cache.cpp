#include "server/prefix_cache.hpp"

#include <algorithm>
#include <functional>

#include "eplb/error.hpp"

namespace fulcrum::server {

PrefixCache::PrefixCache(int64_t num_pages, int page_size, bool enabled)
    : num_pages_(num_pages), page_size_(page_size), enabled_(enabled), root_(std::make_unique<Node>()) {
  FULCRUM_CHECK(num_pages > 0 && num_pages <= INT32_MAX && page_size > 0, "KV pool of {} pages of {} tokens", num_pages,
                page_size);
  root_->ready = true;
  free_.reserve(static_cast<size_t>(num_pages));
  for (int64_t p = num_pages; p-- > 0;) free_.push_back(static_cast<int32_t>(p));
}

PrefixCache::~PrefixCache() = default;

PrefixCache::Match PrefixCache::walk(std::span<const int32_t> prompt) const {
  Match m;
  if (!enabled_ || prompt.empty()) return m;
  const size_t ps = static_cast<size_t>(page_size_);
  const size_t max_pages = (prompt.size() - 1) / ps;  // the last prompt token is always computed
  Node* node = root_.get();
  Key key(ps);
  for (size_t i = 0; i < max_pages; ++i) {
    std::copy_n(prompt.begin() + static_cast<ptrdiff_t>(i * ps), ps, key.begin());
    const auto it = node->children.find(key);
    if (it == node->children.end()) break;
    if (!it->second->ready) {
      m.blocked = true;
      return m;
    }
    node = it->second.get();
    m.ready.push_back(node);
  }
  // Into the next page: in the children's sorted order, the common prefix of the prompt's next tokens with a
  // key only shrinks away from where those tokens would sort, so the nearest ready child on each side is
  // the best of its side (pending ones, being written, are stepped over).
  const size_t begin = m.ready.size() * ps;
  const size_t n = std::min(ps, prompt.size() - 1 - begin);
  if (n == 0 || node->children.empty()) return m;
  const Key next(prompt.begin() + static_cast<ptrdiff_t>(begin), prompt.begin() + static_cast<ptrdiff_t>(begin + n));
  const auto common = [&](const Key& k) {
    const auto end = k.begin() + static_cast<ptrdiff_t>(std::min(n, k.size()));
    return static_cast<int64_t>(std::mismatch(k.begin(), end, next.begin()).first - k.begin());
  };
  const auto consider = [&](Node* child) {  // false: nothing further on this side can do better
    const int64_t c = common(child->key);
    if (c <= m.partial_rows) return false;
    if (!child->ready) return true;
    m.partial = child;
    m.partial_rows = c;
    return false;
  };
  const auto after = node->children.lower_bound(next);
  for (auto it = after; it != node->children.end() && consider(it->second.get()); ++it) {}
  for (auto it = after; it != node->children.begin() && consider(std::prev(it)->second.get()); --it) {}
  return m;
}

PrefixCache::Probe PrefixCache::probe(std::span<const int32_t> prompt, int64_t num_pages) const {
  Probe out;
  const Match m = walk(prompt);
  out.blocked = m.blocked;
  out.num_ready_pages = static_cast<int64_t>(m.ready.size());
  out.num_cached_tokens = out.num_ready_pages * page_size_ + m.partial_rows;
  // Reused pages that sit in the cache unreferenced stop being evictable once this lease holds them (and so
  // does a pinned copy source).
  auto reused_unreferenced = std::count_if(m.ready.begin(), m.ready.end(), [](const Node* n) { return n->refs == 0; });
  if (m.partial != nullptr && m.partial->refs == 0) ++reused_unreferenced;
  const int64_t added = num_pages - out.num_ready_pages;
  out.fits = added <= num_free_pages() + num_unreferenced_ - reused_unreferenced;
  return out;
}

PrefixCache::Lease PrefixCache::acquire(std::span<const int32_t> prompt, int64_t num_pages) {
  const Probe p = probe(prompt, num_pages);
  FULCRUM_CHECK(p.fits && !p.blocked, "prefix cache: acquire of {} pages that do not fit now", num_pages);
  Match m = walk(prompt);
  Lease lease;
  lease.path = std::move(m.ready);
  for (Node* node : lease.path) {
    ref(node);  // before taking pages: a node in use is never evicted
    lease.page_ids.push_back(node->page_id);
  }
  lease.num_cached_tokens = static_cast<int64_t>(lease.path.size()) * page_size_;
  if (m.partial != nullptr) {  // pinned before taking pages too; the copy goes into a fresh page below
    ref(m.partial);
    lease.copy_source = m.partial;
    lease.copy_source_page = m.partial->page_id;
    lease.num_cached_tokens += m.partial_rows;
  }
  while (static_cast<int64_t>(lease.page_ids.size()) < num_pages) lease.page_ids.push_back(take_page());
  if (!enabled_) return lease;
  // The prompt's whole pages past the match: pending nodes, so that requests sharing them wait for them.
  const size_t ps = static_cast<size_t>(page_size_);
  Node* parent = lease.path.empty() ? root_.get() : lease.path.back();
  for (size_t i = lease.path.size(); (i + 1) * ps <= prompt.size(); ++i) {
    Key key(prompt.begin() + static_cast<ptrdiff_t>(i * ps), prompt.begin() + static_cast<ptrdiff_t>((i + 1) * ps));
    if (parent->children.contains(key)) break;  // past the match's last-token limit, or pending elsewhere: ours stays private
    parent = add_child(parent, std::move(key), lease.page_ids[i], false);
    lease.path.push_back(parent);
  }
  return lease;
}

void PrefixCache::on_written(Lease& lease, int64_t num_written) {
  for (size_t i = 0; i < lease.path.size(); ++i) {
    if (static_cast<int64_t>(i + 1) * page_size_ <= num_written) lease.path[i]->ready = true;
  }
  if (lease.copy_source != nullptr && num_written > lease.num_cached_tokens) unpin(lease);
}

void PrefixCache::unpin(Lease& lease) {
  ++clock_;
  unref(std::exchange(lease.copy_source, nullptr));
}

void PrefixCache::release(Lease& lease, std::span<const int32_t> tokens, int64_t num_written) {
  on_written(lease, num_written);
  if (lease.copy_source != nullptr) unpin(lease);
  // Pending nodes (a suffix of the path: pages are written in order) were never written: out of the tree.
  while (!lease.path.empty() && !lease.path.back()->ready) {
    Node* node = lease.path.back();
    FULCRUM_CHECK(node->children.empty() && node->refs == 1, "prefix cache: pending page {} is shared", node->page_id);
    Node* parent = node->parent;
    parent->children.erase(parent->children.find(node->key));
    --num_nodes_;
    update_evictable(parent);
    lease.path.pop_back();
  }
  if (enabled_) {
    const size_t ps = static_cast<size_t>(page_size_);
    const size_t written = static_cast<size_t>(std::min<int64_t>(num_written, static_cast<int64_t>(tokens.size())));
    Node* parent = lease.path.empty() ? root_.get() : lease.path.back();
    size_t i = lease.path.size();
    for (; i < lease.page_ids.size() && (i + 1) * ps <= written; ++i) {
      Key key(tokens.begin() + static_cast<ptrdiff_t>(i * ps), tokens.begin() + static_cast<ptrdiff_t>((i + 1) * ps));
      if (parent->children.contains(key)) break;  // another sequence indexed the same page first: ours goes
      parent = add_child(parent, std::move(key), lease.page_ids[i], true);
      lease.path.push_back(parent);
    }
    if (i == lease.path.size() && i < lease.page_ids.size() && i * ps < written && written < (i + 1) * ps) {
      // Its written partial last page: a leaf to copy from, unless a sibling's key starts with its tokens.
      Key key(tokens.begin() + static_cast<ptrdiff_t>(i * ps), tokens.begin() + static_cast<ptrdiff_t>(written));
      const auto it = parent->children.lower_bound(key);
      const bool covered = it != parent->children.end() && it->first.size() >= key.size() &&
                           std::equal(key.begin(), key.end(), it->first.begin());
      if (!covered) lease.path.push_back(add_child(parent, std::move(key), lease.page_ids[i], true));
    }
  }
  for (size_t i = lease.page_ids.size(); i-- > lease.path.size();) free_.push_back(lease.page_ids[i]);
  ++clock_;
  for (Node* node : lease.path) unref(node);
  lease = Lease{};
}

int64_t PrefixCache::flush() {
  int64_t n = 0;
  while (!evictable_.empty()) {
    evict(evictable_.begin()->second);
    ++n;
  }
  return n;
}

PrefixCache::Dropped PrefixCache::drop_all() {
  Dropped out{.num_prefixes = 0, .num_pages = num_nodes_};
  const std::function<void(const Node&)> count_leaves = [&](const Node& n) {
    for (const auto& [key, child] : n.children) {
      if (child->children.empty()) ++out.num_prefixes;
      count_leaves(*child);
    }
  };
  count_leaves(*root_);
  root_->children.clear();
  evictable_.clear();
  free_.clear();
  for (int64_t p = num_pages_; p-- > 0;) free_.push_back(static_cast<int32_t>(p));
  num_nodes_ = num_unreferenced_ = 0;
  return out;
}

int32_t PrefixCache::take_page() {
  if (free_.empty()) {
    FULCRUM_CHECK(!evictable_.empty(), "prefix cache: no free or evictable page left");
    evict(evictable_.begin()->second);
    ++num_evicted_;
  }
  const int32_t page = free_.back();
  free_.pop_back();
  return page;
}

void PrefixCache::evict(Node* leaf) {
  FULCRUM_CHECK(leaf->refs == 0 && leaf->children.empty() && leaf->in_evictable, "prefix cache: page {} is not evictable",
                leaf->page_id);
  evictable_.erase({leaf->last_use, leaf});
  free_.push_back(leaf->page_id);
  Node* parent = leaf->parent;
  parent->children.erase(parent->children.find(leaf->key));  // destroys leaf
  --num_nodes_;
  --num_unreferenced_;
  update_evictable(parent);
}

void PrefixCache::ref(Node* node) {
  if (node->refs++ == 0) --num_unreferenced_;
  update_evictable(node);
}

void PrefixCache::unref(Node* node) {
  FULCRUM_CHECK(node->refs > 0, "prefix cache: page {} released more often than taken", node->page_id);
  if (--node->refs == 0) {
    ++num_unreferenced_;
    node->last_use = clock_;
  }
  update_evictable(node);
}

void PrefixCache::update_evictable(Node* node) {
  if (node == root_.get()) return;
  const bool should = node->refs == 0 && node->children.empty();
  if (should == node->in_evictable) return;
  if (should) evictable_.insert({node->last_use, node});
  else evictable_.erase({node->last_use, node});
  node->in_evictable = should;
}

PrefixCache::Node* PrefixCache::add_child(Node* parent, Key key, int32_t page_id, bool ready) {
  auto node = std::make_unique<Node>();
  node->parent = parent;
  node->key = key;
  node->page_id = page_id;
  node->ready = ready;
  node->refs = 1;  // the lease that adds it
  Node* raw = node.get();
  parent->children.emplace(std::move(key), std::move(node));
  ++num_nodes_;
  update_evictable(parent);
  return raw;
}

void PrefixCache::check() const {
  std::vector<int> seen(static_cast<size_t>(num_pages_), 0);
  int64_t nodes = 0, unreferenced = 0, evictable = 0;
  const std::function<void(const Node&)> visit = [&](const Node& n) {
    for (const auto& [key, child] : n.children) {
      FULCRUM_CHECK(child->parent == &n && child->key == key && !key.empty() &&
                        static_cast<int>(key.size()) <= page_size_,
                    "prefix cache: node of page {} is linked wrong", child->page_id);
      FULCRUM_CHECK(static_cast<int>(key.size()) == page_size_ || (child->children.empty() && child->ready),
                    "prefix cache: partial page {} is pending or has children", child->page_id);
      FULCRUM_CHECK(child->page_id >= 0 && child->page_id < num_pages_ && seen[static_cast<size_t>(child->page_id)]++ == 0,
                    "prefix cache: page {} twice", child->page_id);
      FULCRUM_CHECK(&n == root_.get() || n.refs >= child->refs, "prefix cache: page {} has fewer refs than its child",
                    n.page_id);
      FULCRUM_CHECK(child->refs > 0 || child->ready, "prefix cache: unreferenced page {} is pending", child->page_id);
      FULCRUM_CHECK(!child->ready || n.ready, "prefix cache: ready page {} below a pending one", child->page_id);
      ++nodes;
      if (child->refs == 0) ++unreferenced;
      const bool leaf_unused = child->refs == 0 && child->children.empty();
      FULCRUM_CHECK(leaf_unused == child->in_evictable, "prefix cache: page {} misfiled for eviction", child->page_id);
      if (child->in_evictable) ++evictable;
      visit(*child);
    }
  };
  visit(*root_);
  for (const int32_t p : free_) {
    FULCRUM_CHECK(p >= 0 && p < num_pages_ && seen[static_cast<size_t>(p)]++ == 0, "prefix cache: free page {} twice", p);
  }
  FULCRUM_CHECK(nodes == num_nodes_ && unreferenced == num_unreferenced_ &&
                    evictable == static_cast<int64_t>(evictable_.size()),
                "prefix cache: counts {} / {} / {} against {} / {} / {}", nodes, unreferenced, evictable, num_nodes_,
                num_unreferenced_, evictable_.size());
}

}  // namespace fulcrum::server
