// FP8 experts on the GPU: the slot pool's FP8 blobs (codes + block scales), the MoE layer's FP8 paths and
// migration of FP8 slots.
//  - fill: every slot's codes are model::random_e4m3_reference of its logical expert's seed and its scales
//    model::expert_fp8_block_scale (which differs between experts), bit for bit; blobs are contiguous and the scales sit inside them;
//  - the FP8 layer against the CPU reference on the dequantized weights (model::moe::moe_layer_reference):
//      skinny path (bf16 activations, FP8 weights): ||gpu - ref|| / ||ref|| <= 1e-3, as the bf16 layer tests:
//        both use the same fp32 weight values float(code) * scale and round h, act and y to bf16 at the same
//        points; only fp32 summation order differs;
//      CUTLASS FP8 path (activations quantized per 1x128 block to e4m3): <= kQuantizedTolerance = 0.06. e4m3 keeps
//        3 mantissa bits: a value rounds by at most 2^-4 relative, ~2.4% RMS for mantissas spread over [1, 2)
//        (ulp 1/8 at 1.5 on average: (1/8) / sqrt(12) / 1.5); a dot product of independently rounded terms keeps
//        that relative RMS, and the two quantized GEMMs (x, act) add in quadrature: ~3.4%, plus bf16 roundings;
//  - placement invariance, bitwise: the same logical experts in P = E slots and in P = E + 4 shuffled slots with
//    replicas (static choice) give the same output on both paths; a CUDA-graph replay equals the eager forward;
//  - migration (comm::NcclSlotPoolMigration, one rank per GPU as processes): after commit every slot's blobs —
//    codes AND scales — are byte-equal to its source slot's blobs before the move (one GPU: local copies only;
//    two GPUs: transfers too).
#include <algorithm>
#include <cstring>
#include <numeric>
#include <map>
#include <random>
#include <thread>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "eplb/error.hpp"
#include "gpu/moe/gpu_slot_pool.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "gpu/moe/nccl_slot_pool_migration.hpp"
#include "model/moe_reference.hpp"
#include "model/random_weights.hpp"
#include "model/safetensors.hpp"
#include "moe_cuda_test_util.hpp"
#include "nccl_rank_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using backend::GpuMoeLayer;
using backend::GpuSlotPool;
using model::ExpertTensor;
namespace moe = model::moe;

constexpr double kSkinnyTolerance = 1e-3;
constexpr double kQuantizedTolerance = 0.06;
constexpr uint64_t kSeed = 77;

#define FULCRUM_NEEDS_GPU() \
  if (backend::CudaBackend::device_count() < 1) GTEST_SKIP() << "needs a GPU"

// Dequantized weights [rows * cols] of one generated FP8 expert tensor: float(code) * (fill scale / 448).
std::vector<float> dequantized_expert(int layer, int expert, ExpertTensor tensor, int h, int i) {
  const int64_t n = tensor == ExpertTensor::kGateUp ? 2 * int64_t{i} * h : int64_t{h} * i;
  const std::vector<uint8_t> codes = model::random_e4m3_reference(n, model::expert_weight_seed(kSeed, layer, expert, tensor));
  const float scale = model::expert_fp8_block_scale(tensor, h, i, expert);
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) out[k] = model::f8e4m3_to_f32(codes[k]) * scale;
  return out;
}

TEST(Fp8SlotPool, FillEqualsTheCpuReferenceAndScalesLiveInTheBlob) {
  FULCRUM_NEEDS_GPU();
  const int h = 256, i = 128;
  GpuSlotPool pool({.num_layers = 2, .slots_per_layer = 3, .hidden_size = h, .moe_intermediate_size = i, .fp8 = true}, 0);
  EXPECT_EQ(pool.gate_up_blob_bytes(), backend::fp8_blob_bytes(2 * i, h));
  EXPECT_EQ(pool.gate_up_blob_bytes() % 256, 0);
  for (int32_t b = 0; b + 1 < pool.map().num_buffers(); ++b) {
    EXPECT_EQ(pool.gate_up_blob(b + 1) - pool.gate_up_blob(b), pool.gate_up_blob_bytes());
    EXPECT_EQ(pool.down_blob(b + 1) - pool.down_blob(b), pool.down_blob_bytes());
    EXPECT_EQ(reinterpret_cast<const std::byte*>(pool.gate_up_fp8(b).scales),
              pool.gate_up_blob(b) + backend::fp8_scales_offset(2 * i, h));
  }
  const std::vector<int32_t> experts{5, 1, 5};
  pool.fill_layer(1, experts, kSeed);
  for (int s = 0; s < 3; ++s) {
    const auto [gu, dn] = pool.download_blobs(pool.map().buffer_of(1, s));
    for (const ExpertTensor tensor : {ExpertTensor::kGateUp, ExpertTensor::kDown}) {
      const bool is_gu = tensor == ExpertTensor::kGateUp;
      const std::vector<std::byte>& blob = is_gu ? gu : dn;
      const int64_t rows = is_gu ? 2 * i : h, cols = is_gu ? h : i;
      const std::vector<uint8_t> codes = model::random_e4m3_reference(
          rows * cols, model::expert_weight_seed(kSeed, 1, experts[s], tensor));
      EXPECT_EQ(std::memcmp(blob.data(), codes.data(), codes.size()), 0) << "slot " << s << (is_gu ? " gate_up" : " down");
      const float scale = model::expert_fp8_block_scale(tensor, h, i, experts[s]);
      const float* scales = reinterpret_cast<const float*>(blob.data() + backend::fp8_scales_offset(rows, cols));
      for (int64_t k = 0; k < rows / 128 * (cols / 128); ++k) ASSERT_EQ(scales[k], scale) << "block " << k;
    }
  }
  EXPECT_EQ(pool.download_blobs(pool.map().buffer_of(1, 0)), pool.download_blobs(pool.map().buffer_of(1, 2)));
  EXPECT_THROW(pool.gate_up_buffer(0), fulcrum::Error);  // no bf16 view of FP8 blobs
  EXPECT_THROW(GpuSlotPool({.num_layers = 1, .slots_per_layer = 1, .hidden_size = 256, .moe_intermediate_size = 96,
                            .fp8 = true}, 0),
               fulcrum::Error);  // partial scale blocks: the engine pads I first
}

struct Fp8Case {
  int hidden, intermediate, experts, top_k;
  int64_t tokens;
};

// An FP8 layer whose slots hold logical experts `map` (generated FP8 weights), router from `router`.
struct Fp8Layer {
  Fp8Layer(const Fp8Case& c, const std::vector<int32_t>& map, const DeviceBuffer& router)
      : pool({.num_layers = 1, .slots_per_layer = static_cast<int>(map.size()), .hidden_size = c.hidden,
              .moe_intermediate_size = c.intermediate, .spare = 0, .fp8 = true}, 0) {
    backend::MoeLayerShape shape = moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, static_cast<int>(map.size()), c.tokens);
    shape.fp8_experts = true;
    shape.external_weights = true;
    layer = std::make_unique<GpuMoeLayer>(shape, 0);
    // Layer 0 of the pool; the reference's seeds use layer 0 too.
    pool.fill_layer(0, map, kSeed);
    layer->set_router_weights(router.as<uint16_t>());
    layer->set_fp8_slot_weights(pool.fp8_ptrs(0));
    const eplb::Topology topo{static_cast<int>(map.size()), 1, 1};
    layer->set_replica_choice(moe::make_replica_choice(eplb::DispatchAlgorithm::kStatic, map, c.experts, topo, c.tokens, {}));
  }
  GpuSlotPool pool;
  std::unique_ptr<GpuMoeLayer> layer;
};

std::vector<float> run_forward(GpuMoeLayer& layer, const DeviceBuffer& x, const DeviceBuffer& logits, int64_t tokens,
                               int hidden) {
  DeviceBuffer out(sizeof(float) * tokens * hidden);
  EXPECT_EQ(cudaMemset(out.as<void>(), 0xff, out.bytes()), cudaSuccess);
  layer.forward_from_logits(x.as<uint16_t>(), logits.as<float>(), tokens, out.as<float>());
  layer.synchronize();
  return to_host(out.as<float>(), tokens * hidden);
}

TEST(Fp8MoeLayer, MatchesTheDequantizedReferenceOnBothPaths) {
  FULCRUM_NEEDS_GPU();
  for (const Fp8Case c : {Fp8Case{256, 256, 16, 4, 3}, Fp8Case{256, 256, 16, 4, 300}, Fp8Case{2048, 768, 16, 8, 2},
                          Fp8Case{2048, 768, 16, 8, 257}}) {
    SCOPED_TRACE(::testing::Message() << "H " << c.hidden << " I " << c.intermediate << " T " << c.tokens);
    std::vector<int32_t> map(static_cast<size_t>(c.experts));
    std::iota(map.begin(), map.end(), 0);
    const DeviceBuffer router = to_device(to_bits(random_bf16_values(int64_t{c.experts} * c.hidden, 3, 0.05f)));
    Fp8Layer f(c, map, router);
    const bool skinny = f.layer->uses_skinny(c.tokens);
    EXPECT_EQ(skinny, c.tokens * c.top_k <= backend::kDefaultSkinnyMaxEntries);
    if (!skinny) ASSERT_TRUE(f.layer->uses_cutlass()) << f.layer->cutlass_fallback_reason();
    const std::vector<float> x = random_bf16_values(c.tokens * c.hidden, 4, 1.0f);
    const std::vector<float> logits = random_logits(c.tokens, c.experts, 5);
    const std::vector<float> got = run_forward(*f.layer, to_device(to_bits(x)), to_device(logits), c.tokens, c.hidden);
    std::vector<float> gate_up, down;
    for (const int32_t e : map) {
      const std::vector<float> g = dequantized_expert(0, e, ExpertTensor::kGateUp, c.hidden, c.intermediate);
      const std::vector<float> d = dequantized_expert(0, e, ExpertTensor::kDown, c.hidden, c.intermediate);
      gate_up.insert(gate_up.end(), g.begin(), g.end());
      down.insert(down.end(), d.begin(), d.end());
    }
    const eplb::Topology topo{c.experts, 1, 1};
    const std::vector<float> ref = moe::moe_layer_reference(
        x, logits, c.tokens, gate_up, down, c.hidden, c.intermediate, c.top_k, true,
        moe::make_replica_choice(eplb::DispatchAlgorithm::kStatic, map, c.experts, topo, c.tokens, {}));
    const double rel = relative_error(got, ref);
    std::cout << "[ fp8 layer ] H " << c.hidden << " T " << c.tokens << (skinny ? " skinny" : " cutlass fp8")
              << ": rel " << rel << "\n";
    EXPECT_LE(rel, skinny ? kSkinnyTolerance : kQuantizedTolerance);
  }
}

TEST(Fp8MoeLayer, PlacementAndGraphReplayDoNotChangeTheOutput) {
  FULCRUM_NEEDS_GPU();
  for (const int64_t tokens : {int64_t{3}, int64_t{333}}) {
    const Fp8Case c{256, 256, 16, 4, tokens};
    SCOPED_TRACE(::testing::Message() << "T " << tokens);
    std::vector<int32_t> identity(static_cast<size_t>(c.experts));
    std::iota(identity.begin(), identity.end(), 0);
    std::vector<int32_t> replicated = identity;
    replicated.insert(replicated.end(), {0, 0, 0, 5});
    std::mt19937 rng(42);
    std::shuffle(replicated.begin(), replicated.end(), rng);
    const DeviceBuffer router = to_device(to_bits(random_bf16_values(int64_t{c.experts} * c.hidden, 3, 0.05f)));
    Fp8Layer first(c, identity, router), second(c, replicated, router);
    std::vector<float> logits = random_logits(c.tokens, c.experts, 6);
    for (int64_t t = 0; t < c.tokens; ++t) logits[t * c.experts] += 3.0f;  // expert 0 is hot
    const DeviceBuffer d_x = to_device(to_bits(random_bf16_values(c.tokens * c.hidden, 7, 1.0f)));
    const DeviceBuffer d_logits = to_device(logits);
    const std::vector<float> expected = run_forward(*first.layer, d_x, d_logits, c.tokens, c.hidden);
    EXPECT_TRUE(bitwise_equal(run_forward(*second.layer, d_x, d_logits, c.tokens, c.hidden), expected));
    // Captured once, replayed: the same bits.
    DeviceBuffer out(sizeof(float) * c.tokens * c.hidden);
    cudaStream_t stream = first.layer->stream();
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    first.layer->forward_from_logits(d_x.as<uint16_t>(), d_logits.as<float>(), c.tokens, out.as<float>());
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaMemset(out.as<void>(), 0xff, out.bytes()), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(bitwise_equal(to_host(out.as<float>(), c.tokens * c.hidden), expected)) << "graph replay";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

TEST(Fp8MoeLayer, CublasIsRefusedWithAOneLineError) {
  FULCRUM_NEEDS_GPU();
  const Fp8Case c{256, 256, 16, 4, 64};
  std::vector<int32_t> map(16);
  std::iota(map.begin(), map.end(), 0);
  const DeviceBuffer router = to_device(to_bits(random_bf16_values(int64_t{c.experts} * c.hidden, 3, 0.05f)));
  Fp8Layer f(c, map, router);
  f.layer->set_expert_gemm(backend::ExpertGemm::kGrouped);
  const DeviceBuffer d_x = to_device(to_bits(random_bf16_values(c.tokens * c.hidden, 7, 1.0f)));
  const DeviceBuffer d_logits = to_device(random_logits(c.tokens, c.experts, 6));
  DeviceBuffer out(sizeof(float) * c.tokens * c.hidden);
  try {
    f.layer->forward_from_logits(d_x.as<uint16_t>(), d_logits.as<float>(), c.tokens, out.as<float>());
    ADD_FAILURE() << "cuBLAS expert GEMMs ran on FP8 experts";
  } catch (const fulcrum::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("FP8"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

// Rank process: every rank moves FP8 slots by a plan; after commit each slot's blobs are byte-equal to what its
// source slot held before (codes and scales), on every rank.
TEST(NcclRank, Fp8SlotMigrationMovesScalesWithWeights) {
  FULCRUM_RANK_ONLY(env);
  auto world = comm::join_local_world(*env);
  auto migration_comm = world->duplicate();
  const int ranks = world->size(), spr = 4, p = spr * ranks;
  const eplb::Topology topo{.num_physical_experts = p, .num_gpus = ranks, .num_nodes = 1};
  GpuSlotPool pool({.num_layers = 1, .slots_per_layer = spr, .hidden_size = 256, .moe_intermediate_size = 128, .fp8 = true},
                   env->rank);
  std::vector<int32_t> from(static_cast<size_t>(p));
  for (int s = 0; s < p; ++s) from[s] = s % (p - 1);  // p - 1 experts, the first one twice
  pool.fill_layer(0, std::vector<int32_t>(from.begin() + env->rank * spr, from.begin() + (env->rank + 1) * spr), kSeed);
  // Blobs of every logical expert as generated (a replica's blobs are its expert's).
  std::map<int32_t, std::pair<std::vector<std::byte>, std::vector<std::byte>>> blob_of;
  for (int s = 0; s < spr; ++s) blob_of[from[env->rank * spr + s]] = pool.download_blobs(pool.map().buffer_of(0, s));
  // Experts differ in their block scales too (expert_fp8_block_scale), so a scale left behind would show.
  std::vector<int32_t> to = from;
  std::reverse(to.begin(), to.end());  // every slot changes expert; across ranks when there are several
  comm::NcclSlotPoolMigration migration(pool, *migration_comm, topo);
  migration.begin_layer(0, from, to);
  while (!migration.ready()) std::this_thread::yield();
  migration.commit(nullptr);
  for (int s = 0; s < spr; ++s) {
    const int32_t expert = to[env->rank * spr + s];
    const auto got = pool.download_blobs(pool.map().buffer_of(0, s));
    // The expected blobs: generated for that expert (this rank may not have held it before: regenerate).
    GpuSlotPool fresh({.num_layers = 1, .slots_per_layer = 1, .hidden_size = 256, .moe_intermediate_size = 128,
                       .spare = 0, .fp8 = true}, env->rank);
    fresh.fill_layer(0, std::vector<int32_t>{expert}, kSeed);
    EXPECT_TRUE(got == fresh.download_blobs(fresh.map().buffer_of(0, 0))) << "rank " << env->rank << " slot " << s;
    if (blob_of.count(expert) != 0) EXPECT_TRUE(got == blob_of[expert]) << "rank " << env->rank << " slot " << s;
  }
  world->barrier();
}

TEST(Fp8SlotMigration, LocalCopiesOnOneGpu) {
  FULCRUM_NEEDS_GPU();
  EXPECT_EQ(run_rank_processes(1, "NcclRank.Fp8SlotMigrationMovesScalesWithWeights"), (std::vector<int>{0}));
}

TEST(Fp8SlotMigration, TransfersOnTwoGpus) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.Fp8SlotMigrationMovesScalesWithWeights"), (std::vector<int>{0, 0}));
}

}  // namespace
}  // namespace fulcrum::test
