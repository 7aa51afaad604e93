// The CPU reference of the device fill (model::random_bf16_reference): value i depends only on (seed, i), as
// the kernel computes it (splitmix64 of seed + (i + 1) * golden, taken here from eplb::SplitMix64 started
// i steps in), lies in [-scale, scale], and expert weights get distinct streams per (layer, expert, tensor).
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "eplb/dispatch.hpp"
#include "model/checkpoint_writer.hpp"
#include "model/random_weights.hpp"
#include "test_data.hpp"

namespace fulcrum::model {
namespace {

TEST(RandomWeights, ValueIDependsOnlyOnSeedAndIndexAsTheKernelComputesIt) {
  const uint64_t seed = 0x1234abcdULL;
  const float scale = 0.03125f;
  const std::vector<uint16_t> values = random_bf16_reference(1000, seed, scale);
  const std::vector<uint16_t> prefix = random_bf16_reference(19, seed, scale);
  EXPECT_EQ(prefix, std::vector<uint16_t>(values.begin(), values.begin() + 19));
  for (const int64_t i : {0, 1, 18, 511, 999}) {
    eplb::SplitMix64 at_i(seed + static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ULL);  // the kernel's indexing
    const float u = static_cast<float>(at_i.next() >> 40) / 16777216.0f;
    EXPECT_EQ(values[static_cast<size_t>(i)], f32_to_bf16_bits((2.0f * u - 1.0f) * scale)) << i;
  }
  double sum = 0;
  std::set<uint16_t> distinct;
  for (const uint16_t v : values) {
    const float x = bf16_bits_to_f32(v);
    EXPECT_LE(std::fabs(x), scale);
    sum += x;
    distinct.insert(v);
  }
  EXPECT_LT(std::fabs(sum / 1000), 0.1 * scale);  // centred
  EXPECT_GT(distinct.size(), 200u);
  EXPECT_TRUE(random_bf16_reference(0, seed, scale).empty());
  EXPECT_NE(test::error_of([] { random_bf16_reference(-1, 1, 1.0f); }).find("negative count -1"), std::string::npos);
}

TEST(RandomWeights, ExpertTensorsHaveDistinctStreamsAndTheirShapes) {
  std::set<uint64_t> seeds;
  for (int layer = 0; layer < 94; ++layer) {
    for (int expert = 0; expert < 256; ++expert) {
      seeds.insert(expert_weight_seed(5, layer, expert, ExpertTensor::kGateUp));
      seeds.insert(expert_weight_seed(5, layer, expert, ExpertTensor::kDown));
    }
  }
  EXPECT_EQ(seeds.size(), 94u * 256u * 2u);
  EXPECT_NE(expert_weight_seed(5, 0, 0, ExpertTensor::kGateUp), expert_weight_seed(6, 0, 0, ExpertTensor::kGateUp));
  // H 16, I 4: gate_up [8, 16] with scale 1/4, down [16, 4] with scale 1/2.
  const std::vector<uint16_t> gate_up = expert_weights_reference(5, 2, 7, ExpertTensor::kGateUp, 16, 4);
  const std::vector<uint16_t> down = expert_weights_reference(5, 2, 7, ExpertTensor::kDown, 16, 4);
  EXPECT_EQ(gate_up, random_bf16_reference(128, expert_weight_seed(5, 2, 7, ExpertTensor::kGateUp), 0.25f));
  EXPECT_EQ(down, random_bf16_reference(64, expert_weight_seed(5, 2, 7, ExpertTensor::kDown), 0.5f));
}

}  // namespace
}  // namespace fulcrum::model
