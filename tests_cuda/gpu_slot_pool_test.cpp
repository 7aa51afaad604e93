// GpuSlotPool on one GPU: the device fill equals the CPU reference bit for bit (awkward sizes), uploads land
// in the mapped buffers, consecutive buffers are adjacent in one allocation per tensor, the per-slot pointers
// follow remaps, and bad input is a one-line error.
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/moe/gpu_slot_pool.hpp"
#include "model/random_weights.hpp"
#include "slot_pool_test_util.hpp"
#include "test_data.hpp"

namespace fulcrum::test {
namespace {

#define FULCRUM_NEEDS_GPU() \
  if (backend::CudaBackend::device_count() < 1) GTEST_SKIP() << "needs a GPU"

TEST(GpuSlotPool, FillEqualsTheCpuReferenceForEverySlot) {
  FULCRUM_NEEDS_GPU();
  backend::GpuSlotPool pool({.num_layers = 2, .slots_per_layer = 3, .hidden_size = 19, .moe_intermediate_size = 7}, 0);
  const std::vector<int32_t> experts0{4, 0, 4}, experts1{1, 2, 3};  // a replica: expert 4 twice
  pool.fill_layer(0, experts0, 11);
  pool.fill_layer(1, experts1, 11);
  expect_slots_hold(pool, 0, experts0, 11);
  expect_slots_hold(pool, 1, experts1, 11);
  EXPECT_EQ(pool.download_slot(0, 0), pool.download_slot(0, 2));
  EXPECT_NE(pool.download_slot(0, 0).first, pool.download_slot(1, 0).first);  // layers differ
  // Spare buffers are untouched storage; the shape's spare defaults to one layer.
  EXPECT_EQ(pool.shape().spare, 3);
  EXPECT_EQ(pool.map().num_buffers(), 9);
}

TEST(GpuSlotPool, BuffersAreContiguousAndPointersFollowTheMap) {
  FULCRUM_NEEDS_GPU();
  backend::GpuSlotPool pool({.num_layers = 2, .slots_per_layer = 4, .hidden_size = 8, .moe_intermediate_size = 3}, 0);
  for (int32_t b = 0; b + 1 < pool.map().num_buffers(); ++b) {
    EXPECT_EQ(pool.gate_up_buffer(b + 1) - pool.gate_up_buffer(b), pool.gate_up_elems());
    EXPECT_EQ(pool.down_buffer(b + 1) - pool.down_buffer(b), pool.down_elems());
  }
  pool.map().reserve(1, 1);
  pool.map().remap(1, 2, 8);
  const std::vector<const uint16_t*> gate_up = pool.gate_up_ptrs(1), down = pool.down_ptrs(1);
  ASSERT_EQ(gate_up.size(), 4u);
  EXPECT_EQ(gate_up[2], pool.gate_up_buffer(8));
  EXPECT_EQ(down[2], pool.down_buffer(8));
  EXPECT_EQ(gate_up[3], pool.gate_up_buffer(7));
  // An upload goes through the map: slot 2 of layer 1 is buffer 8 now.
  std::vector<uint16_t> up(4 * pool.gate_up_elems()), dn(4 * pool.down_elems());
  for (size_t i = 0; i < up.size(); ++i) up[i] = static_cast<uint16_t>(i * 7 + 1);
  for (size_t i = 0; i < dn.size(); ++i) dn[i] = static_cast<uint16_t>(i * 3 + 2);
  pool.upload_layer(1, up, dn);
  const auto [got_up, got_dn] = pool.download_buffer(8);
  EXPECT_EQ(got_up, std::vector<uint16_t>(up.begin() + 2 * pool.gate_up_elems(), up.begin() + 3 * pool.gate_up_elems()));
  EXPECT_EQ(got_dn, std::vector<uint16_t>(dn.begin() + 2 * pool.down_elems(), dn.begin() + 3 * pool.down_elems()));
}

TEST(GpuSlotPool, BadInputIsAOneLineError) {
  FULCRUM_NEEDS_GPU();
  backend::GpuSlotPool pool({.num_layers = 1, .slots_per_layer = 2, .hidden_size = 4, .moe_intermediate_size = 2}, 0);
  const std::vector<std::pair<std::function<void()>, std::string>> cases{
      {[&] { pool.fill_layer(0, std::vector<int32_t>{1}, 0); }, "slot pool: layer 0 fill with 1 experts for 2 slots"},
      {[&] { pool.fill_layer(1, std::vector<int32_t>{1, 2}, 0); }, "slot pool: layer 1 outside [0, 1)"},
      {[&] { pool.fill_layer(0, std::vector<int32_t>{1, -2}, 0); }, "slot pool: layer 0 slot 1: logical expert -2"},
      {[&] { pool.upload_layer(0, std::vector<uint16_t>(3), std::vector<uint16_t>(16)); },
       "slot pool: layer 0 upload of gate_up 3 / down 16 values, expected 2 x 16 / 2 x 8"},
      {[&] { pool.gate_up_buffer(4); }, "slot pool: buffer 4 outside [0, 4)"},
      {[] { backend::GpuSlotPool({.num_layers = 1, .slots_per_layer = 2, .hidden_size = 0, .moe_intermediate_size = 2}); },
       "slot pool: hidden 0 / intermediate 2 must be positive"},
  };
  for (const auto& [call, message] : cases) {
    const std::string error = error_of(call);
    EXPECT_NE(error.find(message), std::string::npos) << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  }
}

}  // namespace
}  // namespace fulcrum::test
