#pragma once
// CPU reference of the GPU MoE layer (src/backend/cuda/moe_*), one function per kernel, in plain C++.
// The GPU layer keeps its tensors in bf16 and accumulates in fp32; this reference rounds to bf16 at the
// same points (expert GEMM outputs, the SwiGLU activation), so the two differ only by fp32 summation
// order. Routing is the model's (CpuBackend::route semantics); replica choice is the EPLB core's
// (eplb::build_static_dispatch table lookup, eplb::DynamicDispatcher draws in the engine's entry order,
// eplb::BalancedSplitter on the pass's counts with engine::ReplicaChooser's route order).
#include <cstdint>
#include <span>
#include <vector>

#include "eplb/dispatch.hpp"
#include "model/backend.hpp"

namespace fulcrum::model::moe {

// How the router turns a logical expert into a physical slot, for one layer. Token t comes from source
// (EP rank) t / tokens_per_source; the GPU router gets the same fields as device arrays.
struct ReplicaChoiceSpec {
  eplb::DispatchAlgorithm algorithm = eplb::DispatchAlgorithm::kStatic;
  int num_logical_experts = 0;
  int num_slots = 0;                     // P
  int num_sources = 1;                   // EP ranks the tokens come from
  int64_t tokens_per_source = 0;         // > 0
  std::vector<int32_t> static_slot_of;   // static: [num_sources][num_logical_experts] -> slot
  std::vector<int32_t> replica_offsets;  // dynamic: [E + 1], eplb::ReplicaIndex::offsets
  std::vector<int32_t> replica_slots;    // dynamic: [P], eplb::ReplicaIndex::slots (ascending per expert)
  std::vector<uint64_t> source_streams;  // dynamic: [num_sources] DynamicDispatcher seed of each source
  std::vector<int32_t> layer_map;        // balanced: [P], for eplb::BalancedSplitter
  eplb::Topology topo;                   // balanced: the splitter's topology (num_gpus == num_sources)
};

// Builds the spec for a layer map [P] over topo (a GPU is a source), from the EPLB core's tables.
// source_streams: dynamic only, one seed per GPU (the engine's per-(seed, pass, layer, source) stream).
ReplicaChoiceSpec make_replica_choice(eplb::DispatchAlgorithm algorithm, std::span<const int32_t> layer_map,
                                      int num_logical_experts, const eplb::Topology& topo, int64_t tokens_per_source,
                                      std::vector<uint64_t> source_streams = {});

// Physical slot of every routing entry [T * top_k] (entries in the router's order: descending probability).
// Dynamic: as the engine, each source's entries are visited token by token, a token's experts ascending,
// and DynamicDispatcher (seeded with the source's stream) draws only for experts with several replicas.
// Balanced: BalancedSplitter on the counts [source][expert] of this choice; a source's entries of expert e
// take the source's routes of e in entry order (a token's experts are distinct, so token order decides).
std::vector<int32_t> choose_slots_reference(const RouterChoice& choice, const ReplicaChoiceSpec& spec);

// Router: softmax / top-k / renormalization exactly as CpuBackend::route on logits [T, E].
RouterChoice route_reference(std::span<const float> logits, int64_t num_tokens, int num_experts, int top_k,
                             bool norm_topk_prob);

// Recorder: histogram[e] += number of entries routed to logical expert e.
void accumulate_histogram_reference(const RouterChoice& choice, std::span<int64_t> histogram);

// Permutation: entries per slot and their exclusive prefix sum [P + 1].
struct SlotLayout {
  std::vector<int32_t> counts;   // [P]
  std::vector<int32_t> offsets;  // [P + 1]
};
SlotLayout slot_layout_reference(std::span<const int32_t> entry_slots, int num_slots);

// bf16 round trip (round to nearest even), as the GPU stores values.
float round_bf16(float value);

// One expert's SwiGLU on rows x [n, H]: h = x @ gate_up^T [n, 2I] (fp32 sum, rounded to bf16),
// act = bf16(silu(gate) * up) [n, I], y = bf16(act @ down^T) [n, H]. gate_up [2I, H] (gate rows then up
// rows), down [H, I]; all inputs hold bf16 values.
std::vector<float> swiglu_expert_reference(std::span<const float> x, int64_t num_rows, std::span<const float> gate_up,
                                           std::span<const float> down, int hidden_size, int intermediate_size);

// Combine: out[t] = sum_j weights[t*k+j] * rows[entry_row[t*k+j]] in fp32, j ascending.
std::vector<float> combine_reference(std::span<const float> rows, std::span<const int32_t> entry_row,
                                     std::span<const float> weights, int64_t num_tokens, int top_k, int hidden_size);

// The whole layer on bf16-valued inputs: x [T, H], logits [T, E], gate_up [P, 2I, H], down [P, H, I]
// -> out [T, H] (fp32), with the intermediate bf16 roundings of the GPU layer.
std::vector<float> moe_layer_reference(std::span<const float> x, std::span<const float> logits, int64_t num_tokens,
                                       std::span<const float> gate_up, std::span<const float> down, int hidden_size,
                                       int intermediate_size, int top_k, bool norm_topk_prob,
                                       const ReplicaChoiceSpec& spec);

}  // namespace fulcrum::model::moe
