// SlotBufferMap: the initial layout, reservations that prefer consecutive buffers, remaps that free the old
// buffer, one-line errors that change nothing, and a fuzz of migrations that keeps every buffer in exactly
// one state and the total at num_layers * slots_per_layer + spare.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>

#include "eplb/error.hpp"
#include "eplb_runtime/slot_buffer_map.hpp"
#include "test_data.hpp"

namespace fulcrum::eplb_runtime {
namespace {

using test::error_of;

std::vector<int32_t> iota(int32_t first, int32_t count) {
  std::vector<int32_t> v(static_cast<size_t>(count));
  std::iota(v.begin(), v.end(), first);
  return v;
}

// Every buffer is live for exactly one (layer, slot), free, or reserved; counts add up to num_buffers.
void expect_consistent(const SlotBufferMap& map) {
  std::multiset<int32_t> seen(map.free_buffers().begin(), map.free_buffers().end());
  EXPECT_TRUE(std::is_sorted(map.free_buffers().begin(), map.free_buffers().end()));
  for (int l = 0; l < map.num_layers(); ++l) {
    for (const int32_t b : map.layer_buffers(l)) seen.insert(b);
    for (const int32_t b : map.reserved(l)) seen.insert(b);
  }
  std::multiset<int32_t> all;
  for (int32_t b = 0; b < map.num_buffers(); ++b) all.insert(b);
  EXPECT_EQ(seen, all);
}

TEST(SlotBufferMap, StartsWithEverySlotInItsOwnBufferAndOneLayerSpare) {
  const SlotBufferMap map(3, 5);
  EXPECT_EQ(map.num_buffers(), 3 * 5 + 5);
  for (int l = 0; l < 3; ++l) {
    for (int s = 0; s < 5; ++s) EXPECT_EQ(map.buffer_of(l, s), l * 5 + s);
    EXPECT_EQ(std::vector<int32_t>(map.layer_buffers(l).begin(), map.layer_buffers(l).end()), iota(l * 5, 5));
  }
  EXPECT_EQ(map.free_buffers(), iota(15, 5));
  EXPECT_EQ(SlotBufferMap(2, 4, 1).num_buffers(), 9);
  EXPECT_EQ(SlotBufferMap(2, 4, 0).num_free(), 0);
}

TEST(SlotBufferMap, RemapMovesASlotToItsReservedBufferAndFreesTheOld) {
  SlotBufferMap map(2, 4);  // buffers 0..7 live, 8..11 free
  EXPECT_EQ(map.reserve(1, 2), (std::vector<int32_t>{8, 9}));
  EXPECT_EQ(map.reserved(1), (std::vector<int32_t>{8, 9}));
  EXPECT_EQ(map.free_buffers(), (std::vector<int32_t>{10, 11}));
  EXPECT_EQ(map.remap(1, 3, 9), 7);
  EXPECT_EQ(map.remap(1, 0, 8), 4);
  EXPECT_EQ(map.buffer_of(1, 3), 9);
  EXPECT_EQ(map.buffer_of(1, 0), 8);
  EXPECT_EQ(map.free_buffers(), (std::vector<int32_t>{4, 7, 10, 11}));
  EXPECT_TRUE(map.reserved(1).empty());
  expect_consistent(map);
}

TEST(SlotBufferMap, ReservePrefersTheLowestConsecutiveRun) {
  SlotBufferMap map(2, 4);
  map.reserve(0, 4);  // 8..11
  for (int s = 0; s < 4; ++s) map.remap(0, s, 8 + s);  // frees 0..3
  map.reserve(1, 2);  // the lowest run of 2: 0, 1
  map.remap(1, 1, 0);  // frees 5
  map.remap(1, 3, 1);  // frees 7
  ASSERT_EQ(map.free_buffers(), (std::vector<int32_t>{2, 3, 5, 7}));
  EXPECT_EQ(map.reserve(0, 3), (std::vector<int32_t>{2, 3, 5}));  // no run of 3: the lowest three
  map.release_reserved(0);
  EXPECT_EQ(map.reserve(1, 1), (std::vector<int32_t>{2}));
  map.remap(1, 0, 2);  // frees 4: now 3, 4, 5 is a run
  EXPECT_EQ(map.free_buffers(), (std::vector<int32_t>{3, 4, 5, 7}));
  EXPECT_EQ(map.reserve(0, 3), (std::vector<int32_t>{3, 4, 5}));
  EXPECT_EQ(map.reserve(1, 0), std::vector<int32_t>{});
  expect_consistent(map);
}

TEST(SlotBufferMap, ReleaseReservedReturnsTheBuffers) {
  SlotBufferMap map(1, 3);
  map.reserve(0, 2);
  EXPECT_EQ(map.release_reserved(0), 2);
  EXPECT_EQ(map.free_buffers(), iota(3, 3));
  EXPECT_EQ(map.release_reserved(0), 0);
}

TEST(SlotBufferMap, MisuseIsAOneLineErrorThatChangesNothing) {
  SlotBufferMap map(2, 3);  // live 0..5, free 6..8
  map.reserve(0, 2);        // 6, 7 for layer 0
  const auto free_before = map.free_buffers();
  const std::vector<std::pair<std::function<void()>, std::string>> cases{
      {[&] { map.reserve(1, 2); }, "layer 1 needs 2 buffers, only 1 of 9 are free"},
      {[&] { map.reserve(0, 1); }, "layer 0 already holds a reservation"},
      {[&] { map.reserve(2, 1); }, "layer 2 outside [0, 2)"},
      {[&] { map.reserve(1, -1); }, "reserve of -1 buffers"},
      {[&] { map.remap(0, 1, 8); }, "remap of layer 0 slot 1 to buffer 8, which is not reserved for layer 0"},
      {[&] { map.remap(1, 1, 6); }, "remap of layer 1 slot 1 to buffer 6, which is not reserved for layer 1"},
      {[&] { map.remap(0, 1, 2); }, "remap of layer 0 slot 1 to buffer 2, which is not reserved for layer 0"},
      {[&] { map.remap(0, 3, 6); }, "local slot 3 outside [0, 3)"},
      {[&] { map.remap(0, 0, 9); }, "buffer 9 outside [0, 9)"},
      {[&] { map.buffer_of(-1, 0); }, "layer -1 outside [0, 2)"},
      {[] { SlotBufferMap(0, 3); }, "0 layers of 3 slots"},
  };
  for (const auto& [call, message] : cases) {
    const std::string error = error_of(call);
    EXPECT_NE(error.find("slot buffer map: " + message), std::string::npos) << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  }
  EXPECT_EQ(map.free_buffers(), free_before);
  EXPECT_EQ(map.reserved(0), (std::vector<int32_t>{6, 7}));
  for (int s = 0; s < 3; ++s) EXPECT_EQ(map.buffer_of(0, s), s);
  expect_consistent(map);
}

// Random migrations layer after layer: a random subset of a layer's slots moves into reserved buffers;
// the total never grows and the spare always suffices for one layer.
TEST(SlotBufferMap, FuzzedMigrationsKeepEveryBufferInOneState) {
  std::mt19937 rng(7);
  for (const int spare : {-1, 2, 7}) {
    SlotBufferMap map(5, 7, spare);
    const int capacity = spare < 0 ? 7 : spare;
    for (int step = 0; step < 300; ++step) {
      const int layer = static_cast<int>(rng() % 5);
      std::vector<int> slots(7);
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      slots.resize(rng() % (capacity + 1));
      ASSERT_EQ(map.num_free(), capacity);
      const std::vector<int32_t> buffers = map.reserve(layer, static_cast<int>(slots.size()));
      for (size_t i = 0; i < slots.size(); ++i) {
        const int32_t old = map.buffer_of(layer, slots[i]);
        EXPECT_EQ(map.remap(layer, slots[i], buffers[i]), old);
      }
      expect_consistent(map);
    }
  }
}

}  // namespace
}  // namespace fulcrum::eplb_runtime
