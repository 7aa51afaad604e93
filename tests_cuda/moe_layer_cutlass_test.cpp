// The GPU MoE layer with CUTLASS expert GEMMs (ExpertGemm::kCutlass, kAuto's choice on one GPU): against the CPU
// reference at awkward token counts, captured in CUDA graphs, under other placements of the same experts,
// with a workspace shared by several layers, and with weights held outside the layer. Shapes: hidden 64 /
// intermediate 48 with 128 experts top-8 (4099 tokens = 32792 rows: the cooperative config), the tiny test
// model's 64 / 16, the real 2048 / 768 and 4096 / 1536 with 16 experts top-4 (so the CPU reference stays
// cheap), and 50 / 22, which CUTLASS cannot run (16-byte TMA strides): cuBLAS, with the reason.
//
// Tolerances and why:
//   1e-3       the layer output vs the bf16 reference, ||gpu - ref|| / ||ref|| (kBf16Tolerance, as
//              moe_layer_test.cpp: both round to bf16 at the same points; fp32 sums in another order)
//   exact      slot counts (fetch_slot_counts) vs the reference; every graph replay vs an eager forward of the
//              same inputs; outputs of two placements of the same experts (a row's GEMM output depends only
//              on the row, its expert's weights and the config, which follows T * k; combine sums each
//              token's k rows in the router's j order); layers sharing a workspace vs twins with their own;
//              external weights vs the same values owned; slot sub-ranges vs the whole expert stage
#include <algorithm>
#include <numeric>
#include <random>
#include <tuple>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "eplb/error.hpp"
#include "model/moe_reference.hpp"
#include "moe_cuda_test_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using backend::ExpertGemm;
using backend::GpuMoeLayer;
using backend::MoeLayerShape;
using backend::MoeWorkspace;
namespace moe = model::moe;
using eplb::DispatchAlgorithm;

struct Case {
  int hidden, intermediate, experts, top_k, extra_slots;
  int64_t tokens;
};

std::string name_of(const Case& c) {
  return fmt::format("H{}_I{}_E{}_k{}_P+{}_T{}", c.hidden, c.intermediate, c.experts, c.top_k, c.extra_slots, c.tokens);
}

moe::ReplicaChoiceSpec one_source_spec(DispatchAlgorithm algorithm, const std::vector<int32_t>& map, int experts,
                                       int64_t tokens) {
  const eplb::Topology topo{static_cast<int>(map.size()), 1, 1};
  return moe::make_replica_choice(algorithm, map, experts, topo, std::max<int64_t>(tokens, 1),
                                  algorithm == DispatchAlgorithm::kDynamic ? std::vector<uint64_t>{0x5eedull}
                                                                           : std::vector<uint64_t>{});
}

// A layer holding weights w (uploaded), on `stream` / `workspace` when given.
std::unique_ptr<GpuMoeLayer> layer_with(const MoeLayerShape& shape, const MoeWeights& w, cudaStream_t stream = nullptr,
                                        std::shared_ptr<MoeWorkspace> workspace = nullptr) {
  auto layer = std::make_unique<GpuMoeLayer>(shape, 0, stream, std::move(workspace));
  layer->upload_weights(to_bits(w.router), to_bits(w.gate_up), to_bits(w.down));
  return layer;
}

std::vector<float> run_forward(GpuMoeLayer& layer, const DeviceBuffer& x, int64_t tokens, const DeviceBuffer& out) {
  layer.forward(x.as<uint16_t>(), tokens, out.as<float>());
  layer.synchronize();
  return to_host(out.as<float>(), tokens * layer.shape().hidden_size);
}

class MoeLayerCutlassTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the GPU MoE tests need a GPU";
    MoeWorkspace probe(moe_shape(64, 48, 16, 4, 16, 1));
    if (!probe.cutlass_unavailable().empty()) GTEST_SKIP() << "CUTLASS path unavailable: " << probe.cutlass_unavailable();
  }
};

// kAuto picks CUTLASS on one GPU; the output matches the bf16 reference for every replica choice; permute reads
// nothing back (slot_counts refuses) unless the choice is balanced; fetch_slot_counts gives the reference's.
TEST_F(MoeLayerCutlassTest, LayerMatchesReference) {
  for (const Case c : {Case{64, 48, 128, 8, 8, 1}, Case{64, 48, 128, 8, 8, 19}, Case{64, 48, 128, 8, 16, 4099},
                       Case{64, 16, 128, 8, 8, 333}, Case{2048, 768, 16, 4, 4, 9}, Case{4096, 1536, 16, 4, 4, 5}}) {
    const int p = c.experts + c.extra_slots;
    const std::vector<int32_t> map = layer_map_for(c.experts, c.extra_slots, 31);
    const MoeWeights w = random_moe_weights(c.hidden, c.intermediate, c.experts, map, 32);
    auto layer = layer_with(moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, p, c.tokens), w);
    EXPECT_TRUE(layer->uses_cutlass()) << layer->cutlass_fallback_reason();
    const std::vector<float> x = random_bf16_values(c.tokens * c.hidden, 33, 1.0f);
    const DeviceBuffer d_x = to_device(to_bits(x));
    DeviceBuffer d_out(sizeof(float) * c.tokens * c.hidden);
    for (const auto algorithm : {DispatchAlgorithm::kStatic, DispatchAlgorithm::kDynamic, DispatchAlgorithm::kBalanced}) {
      SCOPED_TRACE(name_of(c) + " " + std::string(eplb::to_string(algorithm)));
      const moe::ReplicaChoiceSpec spec = one_source_spec(algorithm, map, c.experts, c.tokens);
      layer->set_replica_choice(spec);
      ASSERT_EQ(cudaMemset(d_out.as<void>(), 0xff, d_out.bytes()), cudaSuccess);
      const std::vector<float> out = run_forward(*layer, d_x, c.tokens, d_out);
      const std::vector<float> logits = to_host(layer->logits(), c.tokens * c.experts);
      const std::vector<float> ref = moe::moe_layer_reference(x, logits, c.tokens, w.gate_up, w.down, c.hidden,
                                                              c.intermediate, c.top_k, true, spec);
      const double error = relative_error(out, ref);
      EXPECT_LE(error, kBf16Tolerance);
      if (algorithm != DispatchAlgorithm::kBalanced) {
        EXPECT_THROW(layer->slot_counts(), Error);
      }
      const model::RouterChoice choice = moe::route_reference(logits, c.tokens, c.experts, c.top_k, true);
      const std::span<const int32_t> counts = layer->fetch_slot_counts();
      EXPECT_EQ(std::vector<int32_t>(counts.begin(), counts.end()),
                moe::slot_layout_reference(moe::choose_slots_reference(choice, spec), p).counts);
      fmt::print("  cutlass {} {}: rel err {:.2e}\n", name_of(c), eplb::to_string(algorithm), error);
    }
  }
}

// Hidden 50 / intermediate 22: CUTLASS cannot run it; kAuto and kCutlass fall back to cuBLAS and say why.
TEST_F(MoeLayerCutlassTest, UnalignedShapeFallsBackToCublas) {
  const Case c{50, 22, 128, 8, 8, 77};
  const std::vector<int32_t> map = layer_map_for(c.experts, c.extra_slots, 34);
  const MoeWeights w = random_moe_weights(c.hidden, c.intermediate, c.experts, map, 35);
  auto layer = layer_with(moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, c.experts + c.extra_slots, c.tokens), w);
  const moe::ReplicaChoiceSpec spec = one_source_spec(DispatchAlgorithm::kStatic, map, c.experts, c.tokens);
  layer->set_replica_choice(spec);
  for (const auto gemm : {ExpertGemm::kAuto, ExpertGemm::kCutlass}) {
    layer->set_expert_gemm(gemm);
    EXPECT_FALSE(layer->uses_cutlass());
    EXPECT_NE(layer->cutlass_fallback_reason().find("multiple of 8"), std::string::npos) << layer->cutlass_fallback_reason();
    const std::vector<float> x = random_bf16_values(c.tokens * c.hidden, 36, 1.0f);
    const DeviceBuffer d_x = to_device(to_bits(x));
    DeviceBuffer d_out(sizeof(float) * c.tokens * c.hidden);
    const std::vector<float> out = run_forward(*layer, d_x, c.tokens, d_out);
    const std::vector<float> ref = moe::moe_layer_reference(x, to_host(layer->logits(), c.tokens * c.experts), c.tokens,
                                                            w.gate_up, w.down, c.hidden, c.intermediate, c.top_k, true, spec);
    EXPECT_LE(relative_error(out, ref), kBf16Tolerance);
    EXPECT_NO_THROW(layer->slot_counts());  // the cuBLAS path read them
  }
  layer->set_expert_gemm(ExpertGemm::kGrouped);
  EXPECT_TRUE(layer->cutlass_fallback_reason().empty());  // not asked for
}

// forward (router GEMM included) and forward_from_logits captured once each, with static and dynamic choice;
// replays with new x / logits written into the captured buffers are bitwise the eager forward of the same inputs.
TEST_F(MoeLayerCutlassTest, CapturedForwardReplaysBitwiseAsEager) {
  const Case c{2048, 768, 16, 4, 4, 37};
  const int p = c.experts + c.extra_slots;
  const std::vector<int32_t> map = layer_map_for(c.experts, c.extra_slots, 37);
  const MoeWeights w = random_moe_weights(c.hidden, c.intermediate, c.experts, map, 38);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    auto layer = layer_with(moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, p, c.tokens), w, stream);
    ASSERT_EQ(layer->stream(), stream);
    const int64_t xn = c.tokens * c.hidden, ln = c.tokens * c.experts;
    DeviceBuffer d_x(2 * xn), d_logits(sizeof(float) * ln), d_out(sizeof(float) * xn);
    const auto write = [&](const DeviceBuffer& dst, const auto& host) {
      ASSERT_EQ(cudaMemcpyAsync(dst.template as<void>(), host.data(), sizeof(host[0]) * host.size(), cudaMemcpyHostToDevice,
                                stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    };
    for (const auto algorithm : {DispatchAlgorithm::kStatic, DispatchAlgorithm::kDynamic}) {
      for (const bool from_logits : {false, true}) {
        SCOPED_TRACE(fmt::format("{} {}", eplb::to_string(algorithm), from_logits ? "forward_from_logits" : "forward"));
        const moe::ReplicaChoiceSpec spec = one_source_spec(algorithm, map, c.experts, c.tokens);
        layer->set_replica_choice(spec);
        const auto enqueue = [&] {
          if (from_logits) {
            layer->forward_from_logits(d_x.as<uint16_t>(), d_logits.as<float>(), c.tokens, d_out.as<float>());
          } else {
            layer->forward(d_x.as<uint16_t>(), c.tokens, d_out.as<float>());
          }
        };
        write(d_x, to_bits(random_bf16_values(xn, 39, 1.0f)));
        write(d_logits, random_logits(c.tokens, c.experts, 40));
        enqueue();  // eager first: nothing is created lazily inside the capture
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
        enqueue();  // a host sync, device->host copy or allocation in here fails the capture
        ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        for (uint32_t replay = 0; replay < 3; ++replay) {
          const std::vector<float> x = random_bf16_values(xn, 41 + replay, 1.0f);
          const std::vector<float> logits = random_logits(c.tokens, c.experts, 51 + replay);
          write(d_x, to_bits(x));
          write(d_logits, logits);
          ASSERT_EQ(cudaMemsetAsync(d_out.as<void>(), 0xff, d_out.bytes(), stream), cudaSuccess);
          ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
          ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
          const std::vector<float> replayed = to_host(d_out.as<float>(), xn);
          const std::vector<float> used_logits = to_host(layer->logits(), ln);
          ASSERT_EQ(cudaMemsetAsync(d_out.as<void>(), 0xff, d_out.bytes(), stream), cudaSuccess);
          enqueue();
          ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
          EXPECT_TRUE(bitwise_equal(replayed, to_host(d_out.as<float>(), xn))) << "replay " << replay;
          const std::vector<float> ref = moe::moe_layer_reference(x, from_logits ? logits : used_logits, c.tokens,
                                                                  w.gate_up, w.down, c.hidden, c.intermediate,
                                                                  c.top_k, true, spec);
          EXPECT_LE(relative_error(replayed, ref), kBf16Tolerance) << "replay " << replay;
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
    }
  }
  cudaStreamDestroy(stream);
}

// The same logical experts in two placements: P = E slots in expert order, and P = E + 4 slots shuffled with
// a hot expert (0, favoured by the logits) held 4 times and expert 5 twice. Static choice on both, dynamic on the
// second (splitting expert 0's tokens over its replicas): bitwise the same output, at 333 tokens (pingpong)
// and 4099 tokens top-4 = 16396 rows (cooperative).
TEST_F(MoeLayerCutlassTest, PlacementDoesNotChangeTheOutput) {
  for (const Case c : {Case{2048, 768, 16, 4, 4, 333}, Case{2048, 768, 16, 4, 4, 4099}, Case{64, 48, 128, 8, 4, 333}}) {
    SCOPED_TRACE(name_of(c));
    std::vector<int32_t> identity(static_cast<size_t>(c.experts));
    std::iota(identity.begin(), identity.end(), 0);
    std::vector<int32_t> replicated = identity;
    replicated.insert(replicated.end(), {0, 0, 0, 5});
    std::mt19937 rng(42);
    std::shuffle(replicated.begin(), replicated.end(), rng);
    // Logical experts of the same seed in both: random_moe_weights copies each slot's expert.
    const MoeWeights w_identity = random_moe_weights(c.hidden, c.intermediate, c.experts, identity, 43);
    const MoeWeights w_replicated = random_moe_weights(c.hidden, c.intermediate, c.experts, replicated, 43);
    auto first = layer_with(moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, c.experts, c.tokens), w_identity);
    auto second = layer_with(moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, c.experts + 4, c.tokens), w_replicated);
    std::vector<float> logits = random_logits(c.tokens, c.experts, 44);
    for (int64_t t = 0; t < c.tokens; ++t) logits[t * c.experts] += 3.0f;  // expert 0 is hot
    const DeviceBuffer d_x = to_device(to_bits(random_bf16_values(c.tokens * c.hidden, 45, 1.0f)));
    const DeviceBuffer d_logits = to_device(logits);
    DeviceBuffer d_out(sizeof(float) * c.tokens * c.hidden);
    const auto run = [&](GpuMoeLayer& layer, DispatchAlgorithm algorithm, const std::vector<int32_t>& map) {
      EXPECT_TRUE(layer.uses_cutlass());
      layer.set_replica_choice(one_source_spec(algorithm, map, c.experts, c.tokens));
      ASSERT_EQ(cudaMemset(d_out.as<void>(), 0xff, d_out.bytes()), cudaSuccess);
      layer.forward_from_logits(d_x.as<uint16_t>(), d_logits.as<float>(), c.tokens, d_out.as<float>());
      layer.synchronize();
    };
    std::vector<float> expected, out;
    run(*first, DispatchAlgorithm::kStatic, identity);
    expected = to_host(d_out.as<float>(), c.tokens * c.hidden);
    run(*second, DispatchAlgorithm::kStatic, replicated);
    EXPECT_TRUE(bitwise_equal(to_host(d_out.as<float>(), c.tokens * c.hidden), expected)) << "static, replicated";
    run(*second, DispatchAlgorithm::kDynamic, replicated);
    out = to_host(d_out.as<float>(), c.tokens * c.hidden);
    EXPECT_TRUE(bitwise_equal(out, expected)) << "dynamic, hot expert split over replicas";
    // The hot expert's tokens really were split: several of its slots got rows.
    const std::span<const int32_t> counts = second->fetch_slot_counts();
    int used_replicas = 0;
    for (size_t s = 0; s < replicated.size(); ++s) used_replicas += replicated[s] == 0 && counts[s] > 0;
    EXPECT_GE(used_replicas, 2);
  }
}

// Decode-sized steps on CUTLASS with static replicas route through the single-block plan and a gather
// (kFusedCutlassRouteMaxEntries): the same output, slot counts and recorder counts bit for bit as the multi-launch
// path (router, counts, scan, scatter), though rows sit in another order within their slot.
TEST_F(MoeLayerCutlassTest, FusedSmallRouteEqualsTheMultiLaunchRoute) {
  for (const Case c : {Case{64, 48, 128, 8, 8, 5}, Case{64, 48, 128, 8, 8, 32}, Case{2048, 768, 16, 4, 4, 9},
                       Case{2048, 768, 16, 4, 4, 64}}) {
    SCOPED_TRACE(name_of(c));
    const int p = c.experts + c.extra_slots;
    const std::vector<int32_t> map = layer_map_for(c.experts, c.extra_slots, 51);
    const MoeWeights w = random_moe_weights(c.hidden, c.intermediate, c.experts, map, 52);
    auto layer = layer_with(moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, p, c.tokens), w);
    ASSERT_TRUE(layer->uses_cutlass()) << layer->cutlass_fallback_reason();
    layer->set_replica_choice(one_source_spec(DispatchAlgorithm::kStatic, map, c.experts, c.tokens));
    layer->set_skinny_max_entries(0);  // CUTLASS at every size here
    const DeviceBuffer d_x = to_device(to_bits(random_bf16_values(c.tokens * c.hidden, 53, 1.0f)));
    DeviceBuffer d_out(sizeof(float) * c.tokens * c.hidden);
    DeviceBuffer d_hist(sizeof(unsigned long long) * c.experts);
    layer->set_recorder(d_hist.as<unsigned long long>());
    const auto run = [&](bool fused) {
      layer->set_fused_cutlass_route(fused);
      EXPECT_EQ(layer->fused_cutlass_route_applies(c.tokens), fused);
      EXPECT_EQ(cudaMemset(d_out.as<void>(), 0xff, d_out.bytes()), cudaSuccess);
      EXPECT_EQ(cudaMemset(d_hist.as<void>(), 0, d_hist.bytes()), cudaSuccess);
      const std::vector<float> out = run_forward(*layer, d_x, c.tokens, d_out);
      const std::span<const int32_t> counts = layer->fetch_slot_counts();
      return std::make_tuple(out, std::vector<int32_t>(counts.begin(), counts.end()),
                             to_host(d_hist.as<unsigned long long>(), c.experts));
    };
    const auto [fused_out, fused_counts, fused_hist] = run(true);
    const auto [out, counts, hist] = run(false);
    EXPECT_TRUE(bitwise_equal(fused_out, out));
    EXPECT_EQ(fused_counts, counts);
    EXPECT_EQ(fused_hist, hist);
    EXPECT_EQ(std::accumulate(hist.begin(), hist.end(), 0ull), static_cast<unsigned long long>(c.tokens * c.top_k));
  }
  // Above the bound (and for other replica choices) the multi-launch path runs.
  const Case big{64, 48, 128, 8, 8, 33};
  const std::vector<int32_t> map = layer_map_for(big.experts, big.extra_slots, 54);
  auto layer = layer_with(moe_shape(big.hidden, big.intermediate, big.experts, big.top_k, big.experts + big.extra_slots,
                                    big.tokens),
                          random_moe_weights(big.hidden, big.intermediate, big.experts, map, 55));
  layer->set_replica_choice(one_source_spec(DispatchAlgorithm::kStatic, map, big.experts, big.tokens));
  EXPECT_FALSE(layer->fused_cutlass_route_applies(big.tokens));
  EXPECT_TRUE(layer->fused_cutlass_route_applies(32));
  layer->set_replica_choice(one_source_spec(DispatchAlgorithm::kDynamic, map, big.experts, big.tokens));
  EXPECT_FALSE(layer->fused_cutlass_route_applies(32));
}

// run_experts over slot sub-ranges (an EP rank's share, groups = offsets + first slot) gives bitwise the
// rows of the whole stage.
TEST_F(MoeLayerCutlassTest, SlotRangesGiveTheWholeStage) {
  const Case c{2048, 768, 16, 4, 4, 101};
  const int p = c.experts + c.extra_slots;
  const std::vector<int32_t> map = layer_map_for(c.experts, c.extra_slots, 46);
  auto layer = layer_with(moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, p, c.tokens),
                          random_moe_weights(c.hidden, c.intermediate, c.experts, map, 47));
  layer->set_replica_choice(one_source_spec(DispatchAlgorithm::kStatic, map, c.experts, c.tokens));
  const DeviceBuffer d_x = to_device(to_bits(random_bf16_values(c.tokens * c.hidden, 48, 1.0f)));
  const DeviceBuffer d_logits = to_device(random_logits(c.tokens, c.experts, 49));
  layer->route(d_logits.as<float>(), c.tokens);
  layer->permute(d_x.as<uint16_t>(), c.tokens);
  const int64_t n = c.tokens * c.top_k * c.hidden;
  layer->run_experts(0, p);
  layer->synchronize();
  const std::vector<uint16_t> whole = to_host(layer->expert_out(), n);
  ASSERT_EQ(cudaMemset(const_cast<uint16_t*>(layer->expert_out()), 0xff, 2 * n), cudaSuccess);
  for (const auto& [b, e] : {std::pair{0, 7}, std::pair{7, 7}, std::pair{7, 13}, std::pair{13, 20}}) layer->run_experts(b, e);
  layer->synchronize();
  EXPECT_EQ(to_host(layer->expert_out(), n), whole);
}

// Three layers on one stream sharing one workspace, run in turn (A, B, A again with other inputs, C) eagerly and
// then all captured in one graph: each output is bitwise that of a twin layer with its own workspace, and the
// first vs the reference.
TEST_F(MoeLayerCutlassTest, SharedWorkspaceGivesEachLayerItsOwnResult) {
  const Case c{2048, 768, 16, 4, 4, 29};
  const int p = c.experts + c.extra_slots;
  const MoeLayerShape shape = moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, p, c.tokens);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    const auto workspace = std::make_shared<MoeWorkspace>(shape);
    std::vector<std::unique_ptr<GpuMoeLayer>> shared, twins;
    std::vector<std::vector<int32_t>> maps;
    std::vector<MoeWeights> weights;
    for (int layer_idx = 0; layer_idx < 3; ++layer_idx) {
      maps.push_back(layer_map_for(c.experts, c.extra_slots, 50 + layer_idx));
      weights.push_back(random_moe_weights(c.hidden, c.intermediate, c.experts, maps.back(), 60 + layer_idx));
      shared.push_back(layer_with(shape, weights.back(), stream, workspace));
      twins.push_back(layer_with(shape, weights.back()));
      const auto spec = one_source_spec(DispatchAlgorithm::kDynamic, maps.back(), c.experts, c.tokens);
      shared.back()->set_replica_choice(spec);
      twins.back()->set_replica_choice(spec);
    }
    EXPECT_EQ(shared[0]->workspace(), shared[2]->workspace());
    const int64_t xn = c.tokens * c.hidden;
    std::vector<std::vector<float>> xs;
    std::vector<DeviceBuffer> d_xs, d_outs;
    for (int q = 0; q < 4; ++q) {
      xs.push_back(random_bf16_values(xn, 70 + q, 1.0f));
      d_xs.push_back(to_device(to_bits(xs.back())));
      d_outs.emplace_back(sizeof(float) * xn);
    }
    const int order[4] = {0, 1, 0, 2};  // the layer of each run
    const auto enqueue_all = [&] {
      for (int q = 0; q < 4; ++q) shared[order[q]]->forward(d_xs[q].as<uint16_t>(), c.tokens, d_outs[q].as<float>());
    };
    std::vector<std::vector<float>> expected;
    DeviceBuffer d_twin_out(sizeof(float) * xn);
    for (int q = 0; q < 4; ++q) expected.push_back(run_forward(*twins[order[q]], d_xs[q], c.tokens, d_twin_out));
    const auto check = [&](const char* how) {
      for (int q = 0; q < 4; ++q) {
        EXPECT_TRUE(bitwise_equal(to_host(d_outs[q].as<float>(), xn), expected[q])) << how << ", run " << q;
        ASSERT_EQ(cudaMemset(d_outs[q].as<void>(), 0xff, d_outs[q].bytes()), cudaSuccess);
      }
    };
    enqueue_all();
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    check("eager");
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    enqueue_all();
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    check("graph");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    // The first run against the reference, from the logits its twin computed.
    twins[0]->forward(d_xs[0].as<uint16_t>(), c.tokens, d_twin_out.as<float>());
    twins[0]->synchronize();
    const auto spec = one_source_spec(DispatchAlgorithm::kDynamic, maps[0], c.experts, c.tokens);
    const std::vector<float> ref = moe::moe_layer_reference(xs[0], to_host(twins[0]->logits(), c.tokens * c.experts),
                                                            c.tokens, weights[0].gate_up, weights[0].down, c.hidden,
                                                            c.intermediate, c.top_k, true, spec);
    EXPECT_LE(relative_error(expected[0], ref), kBf16Tolerance);
    // A workspace of another shape is refused.
    EXPECT_THROW(GpuMoeLayer(moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, p + 1, c.tokens), 0, stream, workspace),
                 Error);
  }
  cudaStreamDestroy(stream);
}

// external_weights: no weights of its own; router and slots point at buffers elsewhere (slots in reverse
// order) -> bitwise the owning layer's output. A captured forward follows set_slot_weights: after pointing
// the slots at other weights, the replay gives the eager output of those.
TEST_F(MoeLayerCutlassTest, ExternalWeightsAndPointerSwapsUnderCapture) {
  const Case c{2048, 768, 16, 4, 4, 23};
  const int p = c.experts + c.extra_slots;
  const int64_t h = c.hidden, i = c.intermediate, gate_up_size = 2 * i * h, down_size = h * i;
  const std::vector<int32_t> map = layer_map_for(c.experts, c.extra_slots, 80);
  const MoeWeights w = random_moe_weights(c.hidden, c.intermediate, c.experts, map, 81);
  MoeLayerShape shape = moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, p, c.tokens);
  auto owning = layer_with(shape, w);
  shape.external_weights = true;
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    GpuMoeLayer external(shape, 0, stream, std::make_shared<MoeWorkspace>(shape));
    EXPECT_THROW(external.upload_weights(to_bits(w.router), to_bits(w.gate_up), to_bits(w.down)), Error);
    EXPECT_THROW(external.set_router_weights(nullptr), Error);
    const auto spec = one_source_spec(DispatchAlgorithm::kStatic, map, c.experts, c.tokens);
    owning->set_replica_choice(spec);
    external.set_replica_choice(spec);
    const DeviceBuffer d_x = to_device(to_bits(random_bf16_values(c.tokens * h, 82, 1.0f)));
    DeviceBuffer d_out(sizeof(float) * c.tokens * h);
    EXPECT_THROW(external.forward(d_x.as<uint16_t>(), c.tokens, d_out.as<float>()), Error);  // no router yet
    const ReversedSlotWeights elsewhere(w.gate_up, w.down, p, gate_up_size, down_size);
    const DeviceBuffer d_router = to_device(to_bits(w.router));
    const auto pointers = [&](int shift) { return elsewhere.pointers(shift); };
    external.set_router_weights(d_router.as<uint16_t>());
    EXPECT_THROW(external.forward(d_x.as<uint16_t>(), c.tokens, d_out.as<float>()), Error);  // no expert weights yet
    const auto same = pointers(0), shifted = pointers(1);
    external.set_slot_weights(same.first, same.second);
    EXPECT_TRUE(external.uses_cutlass()) << external.cutlass_fallback_reason();
    const std::vector<float> own = run_forward(*owning, d_x, c.tokens, d_out);
    EXPECT_TRUE(bitwise_equal(run_forward(external, d_x, c.tokens, d_out), own)) << "external weights";

    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    external.forward(d_x.as<uint16_t>(), c.tokens, d_out.as<float>());
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    const auto replay = [&] {
      EXPECT_EQ(cudaMemsetAsync(d_out.as<void>(), 0xff, d_out.bytes(), stream), cudaSuccess);
      EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      return to_host(d_out.as<float>(), c.tokens * h);
    };
    EXPECT_TRUE(bitwise_equal(replay(), own)) << "replay";
    external.set_slot_weights(shifted.first, shifted.second);
    const std::vector<float> shifted_replay = replay();
    EXPECT_FALSE(bitwise_equal(shifted_replay, own)) << "the replay did not follow the new slot pointers";
    EXPECT_TRUE(bitwise_equal(run_forward(external, d_x, c.tokens, d_out), shifted_replay)) << "shifted: replay vs eager";
    external.set_slot_weights(same.first, same.second);
    EXPECT_TRUE(bitwise_equal(replay(), own)) << "replay after pointing back";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    external.set_slot_weights({}, {});  // external: no weights now
    EXPECT_THROW(external.forward(d_x.as<uint16_t>(), c.tokens, d_out.as<float>()), Error);
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace fulcrum::test
