// Sharded loading reads blocks of checkpoint tensors: a block equals the same slice of the full tensor,
// and out-of-range blocks or wrong shapes are one-line errors naming the tensor.
#include <gtest/gtest.h>

#include "model/safetensors.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

TEST(EngineShardLoad, BlockReadsEqualSlicesOfTheFullTensor) {
  model::Checkpoint checkpoint(golden_model_dir("qwen3moe-tiny-dense-mix"));
  const std::string name = "model.layers.0.self_attn.o_proj.weight";  // [64, 64]
  const std::vector<int64_t> shape = {64, 64};
  std::vector<float> full(64 * 64);
  checkpoint.read_f32_into(name, shape, full);
  std::vector<float> block(5 * 7);
  checkpoint.read_f32_block_into(name, shape, 11, 5, 40, 7, block);  // rows [11, 16) x cols [40, 47)
  for (int r = 0; r < 5; ++r) {
    for (int c = 0; c < 7; ++c) EXPECT_EQ(block[r * 7 + c], full[(11 + r) * 64 + 40 + c]);
  }
  std::vector<float> norm(16), norm_block(4);
  checkpoint.read_f32_into("model.layers.0.self_attn.q_norm.weight", std::vector<int64_t>{16}, norm);
  checkpoint.read_f32_block_into("model.layers.0.self_attn.q_norm.weight", std::vector<int64_t>{16}, 0, 1, 12, 4,
                                 norm_block);  // a 1-D tensor is one row
  EXPECT_EQ(norm_block, std::vector<float>(norm.begin() + 12, norm.end()));

  EXPECT_NE(error_of([&] { checkpoint.read_f32_block_into(name, shape, 60, 5, 0, 7, block); })
                .find("block rows [60, 65) x cols [0, 7) is outside tensor '" + name + "' of shape [64, 64]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { checkpoint.read_f32_block_into(name, std::vector<int64_t>{64, 32}, 0, 5, 0, 7, block); })
                .find("has shape [64, 64], expected [64, 32]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { checkpoint.read_f32_block_into(name, shape, 0, 5, 0, 6, block); }).find("destination holds 35"),
            std::string::npos);
}

}  // namespace
}  // namespace fulcrum::test
