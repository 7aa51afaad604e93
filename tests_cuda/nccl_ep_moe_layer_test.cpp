// The expert-parallel MoE layer (comm::NcclEpMoeLayer) on 2 GPU rank processes (nccl_rank_util.hpp). Each
// rank r holds slots [r * P / 2, (r + 1) * P / 2) and its own T_r tokens (source r). Inputs are built on
// every rank from the same seeds as one global batch: source 0's T_0 tokens padded to max(T_r), then source
// 1's T_1 tokens. Padding tokens come after source 0's real ones, so they change neither the static lookup
// nor its dynamic draws; balanced, whose split counts them, runs only without padding (T_0 >= T_1).
// Checked per rank, for static, dynamic and balanced replica choice, grouped and per-slot GEMMs, with awkward sizes
// (37 + 19 tokens, a rank with 0 tokens either side, 4099 + 1000, P with replicas, slots with no rows, the
// Qwen3-30B-A3B hidden/intermediate sizes, hidden 50 / intermediate 22 for the scalar kernel paths):
//   1e-3   the output vs model::moe::moe_layer_reference over the global batch, ||gpu - ref|| / ||ref||: both
//          round to bf16 at the same points and differ only where fp32 sums in another order cross a bf16
//          rounding boundary (as moe_layer_test.cpp)
//   1e-3   the output vs a one-GPU GpuMoeLayer holding all P slots with the same weights and placement, on
//          the global batch: the GEMMs are split per (source, slot) here, per slot there, so cuBLAS may sum
//          in another order (bf16 rounding of the expert rows again)
//   exact  the recorder (this rank's tokens' expert counts), rows sent / received / kept against the
//          reference's slot choice, forward (router GEMM) vs forward_from_logits on its logits, and
//          set_slot_weights with the same values at other addresses (bitwise the same output; shifted
//          pointers must change it)
// Then a timing at the Qwen3-30B-A3B shape (H 2048, I 768, E 128, k 8), 4096 tokens per rank, uniform routing
// (figures only, no threshold).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/moe_kernels.hpp"
#include "comm/nccl_ep_moe_layer.hpp"
#include "eplb/error.hpp"
#include "moe_cuda_test_util.hpp"
#include "nccl_rank_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
namespace moe = model::moe;

constexpr double kBf16Tolerance = 1e-3;
constexpr int kWorld = 2;

struct EpCase {
  int hidden, intermediate, experts, top_k, extra_slots;
  int64_t tokens[kWorld];
};

std::string name_of(const EpCase& c, eplb::DispatchAlgorithm algorithm, backend::ExpertGemm gemm) {
  return fmt::format("H{}_I{}_E{}_k{}_P+{}_T{}+{} {} {}", c.hidden, c.intermediate, c.experts, c.top_k, c.extra_slots,
                     c.tokens[0], c.tokens[1], eplb::to_string(algorithm),
                     gemm == backend::ExpertGemm::kGrouped ? "grouped" : "per-slot");
}

std::vector<float> download_out(comm::NcclEpMoeLayer& ep, const DeviceBuffer& out, int64_t n) {
  ep.layer().synchronize();
  return to_host(out.as<float>(), n);
}

void check_case(comm::NcclCommunicator& world, int device, const EpCase& c, eplb::DispatchAlgorithm algorithm,
                backend::ExpertGemm gemm) {
  SCOPED_TRACE(name_of(c, algorithm, gemm));
  const int rank = world.rank(), p = c.experts + c.extra_slots, l = p / kWorld;
  const int64_t h = c.hidden, i = c.intermediate, k = c.top_k;
  const int64_t per_source = std::max<int64_t>({c.tokens[0], c.tokens[1], 1}), global_tokens = per_source + c.tokens[1];
  const int64_t my_tokens = c.tokens[rank], my_first = rank * per_source;

  const std::vector<int32_t> map = layer_map_for(c.experts, c.extra_slots, 5);
  const MoeWeights w = random_moe_weights(c.hidden, c.intermediate, c.experts, map, 6);
  const std::vector<float> logits = random_logits(global_tokens, c.experts, 7);
  const std::vector<float> x = random_bf16_values(global_tokens * h, 8, 1.0f);
  const eplb::Topology topo{p, kWorld, 1};
  const std::vector<uint64_t> streams = {0xabcdefull, 0x123456ull};
  const moe::ReplicaChoiceSpec spec = moe::make_replica_choice(
      algorithm, map, c.experts, topo, per_source,
      algorithm == eplb::DispatchAlgorithm::kDynamic ? streams : std::vector<uint64_t>{});

  const backend::MoeLayerShape shape = moe_shape(c.hidden, c.intermediate, c.experts, c.top_k, p, per_source);
  comm::NcclEpMoeLayer ep(shape, world, device);
  EXPECT_EQ(ep.slot_begin(), rank * l);
  EXPECT_EQ(ep.num_local_slots(), l);
  ep.layer().upload_weights(to_bits(w.router), to_bits(slot_range(w.gate_up, rank * l, l, 2 * i * h)),
                            to_bits(slot_range(w.down, rank * l, l, h * i)));
  ep.layer().set_expert_gemm(gemm);
  ep.set_replica_choice(spec);
  DeviceBuffer histogram(sizeof(unsigned long long) * c.experts);
  ASSERT_EQ(cudaMemset(histogram.as<void>(), 0, histogram.bytes()), cudaSuccess);
  ep.layer().set_recorder(histogram.as<unsigned long long>());

  const auto mine = [&](const std::vector<float>& global, int64_t width) {
    return std::vector<float>(global.begin() + my_first * width, global.begin() + (my_first + my_tokens) * width);
  };
  const DeviceBuffer d_x = to_device(to_bits(mine(x, h))), d_logits = to_device(mine(logits, c.experts));
  DeviceBuffer d_out(sizeof(float) * std::max<int64_t>(my_tokens, 1) * h);
  ep.forward_from_logits(d_x.as<uint16_t>(), d_logits.as<float>(), my_tokens, d_out.as<float>());
  const std::vector<float> out = download_out(ep, d_out, my_tokens * h);
  const comm::EpForwardStats stats = ep.last_stats();

  // The reference and a one-GPU layer holding every slot, on the global batch.
  const std::vector<float> ref = moe::moe_layer_reference(x, logits, global_tokens, w.gate_up, w.down, c.hidden,
                                                          c.intermediate, c.top_k, true, spec);
  const double ref_error = relative_error(out, mine(ref, h));
  EXPECT_LE(ref_error, kBf16Tolerance);
  backend::MoeLayerShape whole_shape = shape;
  whole_shape.max_tokens = global_tokens;
  backend::GpuMoeLayer whole(whole_shape, device);
  whole.upload_weights(to_bits(w.router), to_bits(w.gate_up), to_bits(w.down));
  whole.set_expert_gemm(gemm);
  whole.set_replica_choice(spec);
  const DeviceBuffer d_all_x = to_device(to_bits(x)), d_all_logits = to_device(logits);
  DeviceBuffer d_whole_out(sizeof(float) * global_tokens * h);
  whole.forward_from_logits(d_all_x.as<uint16_t>(), d_all_logits.as<float>(), global_tokens, d_whole_out.as<float>());
  whole.synchronize();
  const std::vector<float> whole_out = to_host(d_whole_out.as<float>(), global_tokens * h);
  const double whole_error = relative_error(out, mine(whole_out, h));
  EXPECT_LE(whole_error, kBf16Tolerance);

  // Recorder: this rank's tokens only. Rows moved: from the reference's slot choice.
  const model::RouterChoice choice = moe::route_reference(logits, global_tokens, c.experts, c.top_k, true);
  const std::vector<int32_t> slots = moe::choose_slots_reference(choice, spec);
  std::vector<int64_t> expected_hist(static_cast<size_t>(c.experts), 0);
  int64_t local = 0, received = 0;
  for (int src = 0; src < kWorld; ++src) {
    for (int64_t e = src * per_source * k; e < (src * per_source + c.tokens[src]) * k; ++e) {
      const bool here = slots[e] / l == rank;
      if (src == rank) {
        ++expected_hist[static_cast<size_t>(choice.expert_ids[e])];
        local += here;
      } else {
        received += here;
      }
    }
  }
  const auto hist = to_host(histogram.as<unsigned long long>(), c.experts);
  EXPECT_TRUE(std::equal(hist.begin(), hist.end(), expected_hist.begin(),
                         [](unsigned long long a, int64_t b) { return static_cast<int64_t>(a) == b; }));
  EXPECT_EQ(stats.rows_local, local);
  EXPECT_EQ(stats.rows_sent, my_tokens * k - local);
  EXPECT_EQ(stats.rows_received, received);

  // forward runs the router GEMM: bitwise forward_from_logits on the logits it computed.
  ep.layer().set_recorder(nullptr);
  ep.forward(d_x.as<uint16_t>(), my_tokens, d_out.as<float>());
  const std::vector<float> routed = download_out(ep, d_out, my_tokens * h);
  EXPECT_TRUE(std::all_of(routed.begin(), routed.end(), [](float v) { return std::isfinite(v); }));
  const DeviceBuffer d_own_logits = to_device(to_host(ep.layer().logits(), my_tokens * c.experts));
  ep.forward_from_logits(d_x.as<uint16_t>(), d_own_logits.as<float>(), my_tokens, d_out.as<float>());
  EXPECT_TRUE(bitwise_equal(download_out(ep, d_out, my_tokens * h), routed)) << "forward vs forward_from_logits";

  // The local slots' weights in reverse order in other buffers: bitwise the same output; shifted by one
  // slot, another output (where this rank has tokens); empty spans: the layer's own weights again.
  const std::vector<float> gate_up = slot_range(w.gate_up, rank * l, l, 2 * i * h), down = slot_range(w.down, rank * l, l, h * i);
  std::vector<float> gate_up_reversed, down_reversed;
  for (int s = l - 1; s >= 0; --s) {
    gate_up_reversed.insert(gate_up_reversed.end(), gate_up.begin() + s * 2 * i * h, gate_up.begin() + (s + 1) * 2 * i * h);
    down_reversed.insert(down_reversed.end(), down.begin() + s * h * i, down.begin() + (s + 1) * h * i);
  }
  const DeviceBuffer d_gate_up = to_device(to_bits(gate_up_reversed)), d_down = to_device(to_bits(down_reversed));
  const auto run_with = [&](int shift) {
    std::vector<const uint16_t*> gate_up_ptrs, down_ptrs;
    for (int s = 0; s < l; ++s) {
      const int held = l - 1 - (s + shift) % l;
      gate_up_ptrs.push_back(d_gate_up.as<uint16_t>() + held * 2 * i * h);
      down_ptrs.push_back(d_down.as<uint16_t>() + held * h * i);
    }
    ep.layer().set_slot_weights(gate_up_ptrs, down_ptrs);
    ep.forward_from_logits(d_x.as<uint16_t>(), d_logits.as<float>(), my_tokens, d_out.as<float>());
    return download_out(ep, d_out, my_tokens * h);
  };
  EXPECT_TRUE(bitwise_equal(run_with(0), out)) << "the same weights at other addresses";
  const std::vector<float> shifted = run_with(1);
  if (my_tokens > 0) {
    EXPECT_FALSE(bitwise_equal(shifted, out)) << "other weights did not change the output";
  }
  ep.layer().set_slot_weights({}, {});
  ep.forward_from_logits(d_x.as<uint16_t>(), d_logits.as<float>(), my_tokens, d_out.as<float>());
  EXPECT_TRUE(bitwise_equal(download_out(ep, d_out, my_tokens * h), out)) << "own weights again";

  const moe::ReplicaChoiceSpec four_sources =
      moe::make_replica_choice(eplb::DispatchAlgorithm::kStatic, map, c.experts, {p, 2 * kWorld, 1}, per_source);
  EXPECT_THROW(ep.set_replica_choice(four_sources), Error);
  if (rank == 0) {
    fmt::print("  {}: rel err vs reference {:.2e}, vs one-GPU layer {:.2e}; rank 0 kept {} sent {} received {} rows\n",
               name_of(c, algorithm, gemm), ref_error, whole_error, stats.rows_local, stats.rows_sent,
               stats.rows_received);
  }
}

TEST(NcclRank, EpMoeMatchesReference) {
  FULCRUM_RANK_ONLY(env);
  auto world = comm::join_local_world(*env);
  const int device = env->rank % backend::CudaBackend::device_count();
  const EpCase cases[] = {{64, 48, 128, 8, 8, {37, 19}},  {50, 22, 40, 4, 8, {0, 23}}, {64, 48, 128, 8, 0, {11, 0}},
                          {2048, 768, 16, 4, 4, {9, 5}}, {64, 48, 40, 4, 8, {4099, 1000}}};
  for (const EpCase& c : cases) {
    for (const auto algorithm : {eplb::DispatchAlgorithm::kStatic, eplb::DispatchAlgorithm::kDynamic,
                                 eplb::DispatchAlgorithm::kBalanced}) {
      if (algorithm == eplb::DispatchAlgorithm::kBalanced && c.tokens[0] < c.tokens[1]) continue;  // padded
      for (const auto gemm : {backend::ExpertGemm::kGrouped, backend::ExpertGemm::kPerSlot}) {
        check_case(*world, device, c, algorithm, gemm);
      }
    }
  }
  // Bad shapes: P not a multiple of the EP ranks.
  EXPECT_THROW(comm::NcclEpMoeLayer(moe_shape(64, 48, 16, 4, 17, 4), *world, device), Error);
}

// Median of host-timed forwards (each ends with a stream synchronization), after warm-up.
template <typename Fn>
double median_ms(int warmup, int reps, Fn&& fn) {
  for (int r = 0; r < warmup; ++r) fn();
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

TEST(NcclRank, EpMoeTiming) {
  FULCRUM_RANK_ONLY(env);
  auto world = comm::join_local_world(*env);
  const int device = env->rank % backend::CudaBackend::device_count();
  const int rank = world->rank();
  const backend::MoeLayerShape shape = moe_shape(2048, 768, 128, 8, 128, 4096);  // Qwen3-30B-A3B, P = E
  const int64_t t = shape.max_tokens, h = shape.hidden_size;
  comm::NcclEpMoeLayer ep(shape, *world, device);
  ep.layer().randomize_weights(7);
  std::vector<int32_t> map(128);
  std::iota(map.begin(), map.end(), 0);
  const eplb::Topology topo{128, kWorld, 1};
  // Uniform routing: i.i.d. logits, so every expert is equally likely in each token's top-k.
  const DeviceBuffer d_logits = to_device(random_bf16_values(t * 128, 100 + rank, 4.0f));
  DeviceBuffer d_x(2 * t * h), d_out(sizeof(float) * t * h);
  FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(d_x.as<uint16_t>(), t * h, 9 + rank, 1.0f, ep.stream()));
  ep.layer().synchronize();
  const auto forward = [&] {
    ep.forward_from_logits(d_x.as<uint16_t>(), d_logits.as<float>(), t, d_out.as<float>());
    ep.layer().synchronize();
  };
  // P = E: one replica per expert, so dynamic and balanced choose the slots static does; their rows show
  // what the choice itself costs (balanced: a host synchronization in route, the count all-gather, the split).
  const std::vector<uint64_t> streams = {0xabcdefull, 0x123456ull};
  const std::pair<eplb::DispatchAlgorithm, backend::ExpertGemm> configs[] = {
      {eplb::DispatchAlgorithm::kStatic, backend::ExpertGemm::kAuto},
      {eplb::DispatchAlgorithm::kStatic, backend::ExpertGemm::kGrouped},
      {eplb::DispatchAlgorithm::kStatic, backend::ExpertGemm::kPerSlot},
      {eplb::DispatchAlgorithm::kDynamic, backend::ExpertGemm::kAuto},
      {eplb::DispatchAlgorithm::kBalanced, backend::ExpertGemm::kAuto}};
  for (const auto& [algorithm, gemm] : configs) {
    ep.set_replica_choice(moe::make_replica_choice(
        algorithm, map, 128, topo, t, algorithm == eplb::DispatchAlgorithm::kDynamic ? streams : std::vector<uint64_t>{}));
    ep.layer().set_expert_gemm(gemm);
    ep.set_timing(false);
    const double ms = median_ms(3, 20, forward);
    ep.set_timing(true);
    std::vector<comm::EpForwardStats> staged;
    for (int r = 0; r < 5; ++r) {
      forward();
      staged.push_back(ep.last_stats());
    }
    std::sort(staged.begin(), staged.end(), [](const auto& a, const auto& b) { return a.experts_ms < b.experts_ms; });
    const comm::EpForwardStats& s = staged[2];
    const char* name = gemm == backend::ExpertGemm::kAuto ? "auto" : gemm == backend::ExpertGemm::kGrouped ? "grouped" : "per-slot";
    std::printf("EP-2 rank %d, %-8s %-8s: forward %.3f ms median of 20 (%.0f tokens/s per rank); with stage timing: "
                "route+permute %.3f, dispatch %.3f (counts %.3f), experts %.3f, combine-exchange %.3f, combine %.3f ms; "
                "rows kept %lld sent %lld received %lld\n",
                rank, std::string(eplb::to_string(algorithm)).c_str(), name, ms, t / ms * 1e3, s.route_permute_ms,
                s.dispatch_ms, s.count_exchange_ms, s.experts_ms, s.combine_exchange_ms, s.combine_ms,
                static_cast<long long>(s.rows_local), static_cast<long long>(s.rows_sent),
                static_cast<long long>(s.rows_received));
    std::fflush(stdout);
  }
  // The expert stage's alternative: received rows regrouped slot-contiguous over the sources (one problem
  // per local slot instead of per (source, slot)); its GEMMs timed on this rank's last received counts. The
  // regrouping copy itself (every received row once more each way) is not in this figure.
  ep.layer().set_expert_gemm(backend::ExpertGemm::kAuto);
  std::vector<int32_t> segmented(ep.received_counts().begin(), ep.received_counts().end());
  const int l = ep.num_local_slots();
  std::vector<int32_t> regrouped(static_cast<size_t>(l), 0);  // [1][L]
  for (size_t q = 0; q < segmented.size(); ++q) regrouped[q % l] += segmented[q];
  const int64_t n = std::accumulate(segmented.begin(), segmented.end(), int64_t{0});
  DeviceBuffer d_rows(2 * n * h), d_rows_out(2 * n * h);
  FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(d_rows.as<uint16_t>(), n * h, 11, 1.0f, ep.stream()));
  for (const std::vector<int32_t>* counts : {&segmented, &regrouped}) {
    const double ms = median_ms(3, 20, [&] {
      ep.layer().run_experts_on(d_rows.as<uint16_t>(), *counts, d_rows_out.as<uint16_t>());
      ep.layer().synchronize();
    });
    std::printf("EP-2 rank %d experts alone on %lld received rows, %s: %.3f ms (%.0f TFLOP/s)\n", rank,
                static_cast<long long>(n), counts == &segmented ? "per (source, slot)" : "regrouped per slot", ms,
                static_cast<double>(n) * 6.0 * h * shape.moe_intermediate_size / ms * 1e-9);
    std::fflush(stdout);
  }
  world->barrier();

  // For scale: one GPU holding all 128 slots on both ranks' 8192 tokens (rank 0 alone; rank 1 waits).
  if (rank == 0) {
    backend::MoeLayerShape one = shape;
    one.max_tokens = kWorld * t;
    backend::GpuMoeLayer whole(one, device);
    whole.randomize_weights(7);
    whole.set_replica_choice(moe::make_replica_choice(eplb::DispatchAlgorithm::kStatic, map, 128, topo, t));
    const DeviceBuffer d_all_logits = to_device(random_bf16_values(kWorld * t * 128, 100, 4.0f));
    DeviceBuffer d_all_x(2 * kWorld * t * h), d_all_out(sizeof(float) * kWorld * t * h);
    FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(d_all_x.as<uint16_t>(), kWorld * t * h, 9, 1.0f, whole.stream()));
    const double ms = median_ms(3, 20, [&] {
      whole.forward_from_logits(d_all_x.as<uint16_t>(), d_all_logits.as<float>(), kWorld * t, d_all_out.as<float>());
      whole.synchronize();
    });
    std::printf("one GPU, all 128 slots, %lld tokens: forward %.3f ms median of 20 (%.0f tokens/s)\n",
                static_cast<long long>(kWorld * t), ms, kWorld * t / ms * 1e3);
    std::fflush(stdout);
  }
  world->barrier();
}

TEST(NcclEpMoeLayer, MatchesReferenceAndOneGpuLayer) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(kWorld, "NcclRank.EpMoeMatchesReference"), (std::vector<int>{0, 0}));
}

TEST(NcclEpMoeLayer, Timing) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(kWorld, "NcclRank.EpMoeTiming"), (std::vector<int>{0, 0}));
}

}  // namespace
}  // namespace fulcrum::test
