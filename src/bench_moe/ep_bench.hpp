#pragma once
// Pieces of the several-GPU `bench moe` run shared by its EP and migration parts (ep_bench.cpp,
// migration_bench.cpp). Includes CUDA and NCCL-communicator headers: only for those two files.
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpu/moe/moe_layer.hpp"
#include "bench_moe/bench_util.hpp"
#include "comm/nccl_communicator.hpp"
#include "gpu/moe/ep_moe_layer.hpp"
#include "model/moe_reference.hpp"

namespace fulcrum::bench_moe {

double now_ms();
// The largest of every rank's `value` (a collective over `ep`).
double slowest_rank(comm::Communicator& ep, double value);
// Replica choice over `world` EP ranks (each rank's tokens are its source).
model::moe::ReplicaChoiceSpec ep_replica_choice(eplb::DispatchAlgorithm algorithm, const std::vector<int32_t>& map,
                                                int world);
// This rank's routing logits on the device: drawn from `loads`, a different stream per rank.
struct EpRoutingInput {
  EpRoutingInput(const std::vector<double>& loads, int64_t tokens, int rank, uint64_t seed);
  backend::DeviceBuffer logits;  // [T, E] fp32
};
// One collective forward from a barrier to its end on this rank (host clock, ms).
double ep_step_ms(comm::NcclCommunicator& ep, backend::EpMoeLayer& layer, const uint16_t* x, const float* logits,
                  int64_t tokens, float* out);

// Live migration on `migration` while forward passes run on `ep` (migration_bench.cpp); returns its figures.
nlohmann::json run_migration_bench(const MoeBenchOptions& opt, comm::NcclCommunicator& ep,
                                   comm::NcclCommunicator& migration, const ModelShape& model,
                                   const LoadRouting& routing);

}  // namespace fulcrum::bench_moe
