#pragma once
// The expert-parallel MoE layer's check (backend::EpMoeLayer), shared by its tests over NCCL (2 GPU rank
// processes, nccl_ep_moe_layer_test.cpp) and over host-staged rows (2 rank threads on one GPU,
// ep_moe_layer_threads_test.cpp). Each rank r holds slots [r * P / 2, (r + 1) * P / 2) and its own T_r tokens
// (source r). Inputs are built on every rank from the same seeds as one global batch: source 0's T_0 tokens padded
// to max(T_r), then source 1's T_1 tokens. Padding tokens come after source 0's real ones, so they change neither
// the static lookup nor its dynamic draws; balanced, whose split counts them, runs only without padding
// (T_0 >= T_1). Checked per rank, for static, dynamic and balanced replica choice, cuBLAS grouped and per-slot
// GEMMs and CUTLASS (kCutlass: run_experts_on as one grouped GEMM over the (source, slot) groups):
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
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "backend/cuda/cuda_check.hpp"
#include "comm/device_exchange.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "gpu/moe/ep_moe_layer.hpp"
#include "eplb/error.hpp"
#include "moe_cuda_test_util.hpp"

namespace fulcrum::test {

using backend::DeviceBuffer;
namespace moe = model::moe;

constexpr int kWorld = 2;

struct EpCase {
  int hidden, intermediate, experts, top_k, extra_slots;
  int64_t tokens[kWorld];
};

inline std::string name_of(const EpCase& c, eplb::DispatchAlgorithm algorithm, backend::ExpertGemm gemm) {
  return fmt::format("H{}_I{}_E{}_k{}_P+{}_T{}+{} {} {}", c.hidden, c.intermediate, c.experts, c.top_k, c.extra_slots,
                     c.tokens[0], c.tokens[1], eplb::to_string(algorithm),
                     gemm == backend::ExpertGemm::kGrouped   ? "grouped"
                     : gemm == backend::ExpertGemm::kPerSlot ? "per-slot"
                                                             : "cutlass");
}

inline std::vector<float> download_out(backend::EpMoeLayer& ep, const DeviceBuffer& out, int64_t n) {
  ep.layer().synchronize();
  return to_host(out.as<float>(), n);
}

inline void check_ep_case(comm::DeviceExchange& world, int device, const EpCase& c, eplb::DispatchAlgorithm algorithm,
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
  backend::EpMoeLayer ep(shape, world, device);
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
  const backend::EpForwardStats stats = ep.last_stats();

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

// Every case of the EP tests on this rank: awkward sizes (37 + 19 tokens, a rank with 0 tokens either side, 4099 +
// 1000, P with replicas, slots with no rows, the Qwen3-30B-A3B hidden/intermediate sizes, hidden 50 / intermediate
// 22 for the scalar kernel paths), each replica choice and expert GEMM; then a P that does not split over the ranks.
inline void check_every_ep_case(comm::DeviceExchange& world, int device) {
  const EpCase cases[] = {{64, 48, 128, 8, 8, {37, 19}},  {50, 22, 40, 4, 8, {0, 23}}, {64, 48, 128, 8, 0, {11, 0}},
                          {2048, 768, 16, 4, 4, {9, 5}}, {64, 48, 40, 4, 8, {4099, 1000}}};
  for (const EpCase& c : cases) {
    for (const auto algorithm : {eplb::DispatchAlgorithm::kStatic, eplb::DispatchAlgorithm::kDynamic,
                                 eplb::DispatchAlgorithm::kBalanced}) {
      if (algorithm == eplb::DispatchAlgorithm::kBalanced && c.tokens[0] < c.tokens[1]) continue;  // padded
      for (const auto gemm : {backend::ExpertGemm::kGrouped, backend::ExpertGemm::kPerSlot, backend::ExpertGemm::kCutlass}) {
        check_ep_case(world, device, c, algorithm, gemm);
      }
    }
  }
  EXPECT_THROW(backend::EpMoeLayer(moe_shape(64, 48, 16, 4, 17, 4), world, device), Error);
}

}  // namespace fulcrum::test
