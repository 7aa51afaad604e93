#pragma once
// Moves of the fulcrum local search, all aimed at the heaviest GPU h:
//   swap      two slots on different GPUs exchange experts (counts unchanged);
//   reassign  one slot gets another expert (one count up, one down; every GPU holding either changes).
// A move's gain is how much it lowers h's load, capped by the new load of every GPU it raises:
// gain = L_h - max(new loads of h and of the GPUs whose load grows). Only moves with gain > 0 count,
// so the sorted vector of GPU loads decreases lexicographically and the search terminates.
// With an `origin` map (migration-aware replanning) a move's score is gain per slot changed against
// origin (a move that restores an original expert counts as half a move); without one, score = gain.
#include <cstdint>
#include <limits>
#include <span>

#include "eplb/fulcrum_layout.hpp"

namespace fulcrum::eplb::fulcrum_detail {

struct Move {
  enum Kind { kNone, kSwap, kReassign, kSwapPairs };
  Kind kind = kNone;
  int a = -1;  // swap: first slot; reassign: the slot; pair swap: slots a, c of h trade with b, d
  int b = -1;  // swap: second slot; reassign: the new expert
  double score = 0.0;
  int c = -1, d = -1;
  bool valid() const { return kind != kNone; }
};

class MoveFinder {
 public:
  // Searches GPUs [g0, g1) (reassign moves assume the whole range). `origin` may be null.
  MoveFinder(Layout& layout, int g0, int g1, const int32_t* origin)
      : layout_(layout), g0_(g0), g1_(g1), origin_(origin) {}
  // Without an origin, best_swap can instead use an index of the range's slots sorted by replica weight
  // (thread-local buffers: at most one indexed finder per thread at a time). apply() keeps it current.
  // `heaviest_first`, if given, lists every expert by replica weight, heaviest first (saves a sort).
  void build_index(std::span<const int> heaviest_first = {});

  // Best swap of a replica on h with one on another GPU; returns `best` unless something scores higher.
  Move best_swap(int h, Move best = {}) const;
  // best_swap(h) of an indexed finder, given the lightest load among GPUs of the range other than h
  // (equal to the range's lightest load, h being the heaviest).
  // A swap whose gain reaches `enough` is taken at once (the first found, not the best).
  Move best_swap_indexed(int h, double min_other, double enough = std::numeric_limits<double>::infinity()) const;
  // Best exchange of two replicas of h with two of another GPU (origin must be null).
  Move best_pair_swap(int h, double enough = std::numeric_limits<double>::infinity()) const;
  // Best reassign that lowers h: a slot of h to another expert, or a slot elsewhere to an expert of h.
  Move best_reassign(int h, Move best = {}) const;
  void apply(const Move& move) {
    if (move.kind == Move::kSwap) {
      swap(move.a, move.b);
    } else if (move.kind == Move::kReassign) {
      layout_.reassign(move.a, move.b);
      if (indexed_) build_index();  // weights of two experts changed
    } else {
      swap(move.a, move.b);
      swap(move.c, move.d);
    }
  }

 private:
  void swap(int s1, int s2);

  // Change in the number of slots differing from origin if slot s gets expert e.
  int slot_cost(int s, int e) const {
    return static_cast<int>(e != origin_[s]) - static_cast<int>(layout_.expert[s] != origin_[s]);
  }
  double divisor(int cost) const { return origin_ == nullptr ? 1.0 : (cost > 0 ? cost : 0.5); }

  Layout& layout_;
  int g0_, g1_;
  const int32_t* origin_;
  bool indexed_ = false;
};

}  // namespace fulcrum::eplb::fulcrum_detail
