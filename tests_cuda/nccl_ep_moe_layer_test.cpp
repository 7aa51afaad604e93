// The expert-parallel MoE layer (backend::EpMoeLayer) over NCCL on 2 GPU rank processes (nccl_rank_util.hpp):
// the cases and tolerances of ep_moe_layer_check.hpp. Timings: `fulcrum bench moe --gpus 2` (docs/benchmarks.md).
#include <gtest/gtest.h>

#include "ep_moe_layer_check.hpp"
#include "nccl_rank_util.hpp"

namespace fulcrum::test {
namespace {

TEST(NcclRank, EpMoeMatchesReference) {
  FULCRUM_RANK_ONLY(env);
  auto world = comm::join_local_world(*env);
  check_every_ep_case(*world, env->rank % backend::CudaBackend::device_count());
}

TEST(NcclEpMoeLayer, MatchesReferenceAndOneGpuLayer) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(kWorld, "NcclRank.EpMoeMatchesReference"), (std::vector<int>{0, 0}));
}

}  // namespace
}  // namespace fulcrum::test
