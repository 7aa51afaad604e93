// CPU reference of the GPU MoE layer's kernels (see moe_reference.hpp).
#include "model/moe_reference.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cpu/cpu_backend.hpp"
#include "eplb/error.hpp"
#include "model/checkpoint_writer.hpp"
#include "model/parallel_chunks.hpp"

namespace fulcrum::model::moe {

ReplicaChoiceSpec make_replica_choice(eplb::DispatchAlgorithm algorithm, std::span<const int32_t> layer_map,
                                      int num_logical_experts, const eplb::Topology& topo, int64_t tokens_per_source,
                                      std::vector<uint64_t> source_streams) {
  FULCRUM_CHECK(tokens_per_source > 0, "tokens_per_source must be positive, got {}", tokens_per_source);
  ReplicaChoiceSpec spec;
  spec.algorithm = algorithm;
  spec.num_logical_experts = num_logical_experts;
  spec.num_slots = topo.num_physical_experts;
  spec.num_sources = topo.num_gpus;
  spec.tokens_per_source = tokens_per_source;
  if (algorithm == eplb::DispatchAlgorithm::kStatic) {
    spec.static_slot_of = eplb::build_static_dispatch(layer_map, num_logical_experts, topo).slot_of;
  } else if (algorithm == eplb::DispatchAlgorithm::kBalanced) {
    const eplb::ReplicaIndex check(layer_map, num_logical_experts, topo);  // validates the map
    spec.replica_offsets = check.offsets;
    spec.replica_slots = check.slots;
    spec.layer_map.assign(layer_map.begin(), layer_map.end());
    spec.topo = topo;
  } else {
    FULCRUM_CHECK(static_cast<int>(source_streams.size()) == topo.num_gpus,
                  "dynamic dispatch needs one stream per source: {} for {} sources", source_streams.size(),
                  topo.num_gpus);
    const eplb::ReplicaIndex replicas(layer_map, num_logical_experts, topo);
    spec.replica_offsets = replicas.offsets;
    spec.replica_slots = replicas.slots;
    spec.source_streams = std::move(source_streams);
  }
  return spec;
}

RouterChoice route_reference(std::span<const float> logits, int64_t num_tokens, int num_experts, int top_k,
                             bool norm_topk_prob) {
  FULCRUM_CHECK(static_cast<int64_t>(logits.size()) == num_tokens * num_experts, "route: {} logits for {} x {}",
                logits.size(), num_tokens, num_experts);
  backend::CpuBackend cpu;
  const Tensor t = cpu.zeros({num_tokens, int64_t{num_experts}});  // [T, E]
  cpu.upload(t, logits);
  return cpu.route(t, top_k, norm_topk_prob);
}

std::vector<int32_t> choose_slots_reference(const RouterChoice& choice, const ReplicaChoiceSpec& spec) {
  const int top_k = choice.top_k;
  const auto num_tokens = static_cast<int64_t>(choice.expert_ids.size()) / top_k;
  std::vector<int32_t> slots(choice.expert_ids.size(), -1);
  const int num_experts = spec.num_logical_experts;
  if (spec.algorithm == eplb::DispatchAlgorithm::kStatic) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t source = t / spec.tokens_per_source;
      FULCRUM_CHECK(source < spec.num_sources, "token {} has source {} of {}", t, source, spec.num_sources);
      for (int j = 0; j < top_k; ++j) {
        const size_t entry = static_cast<size_t>(t * top_k + j);
        slots[entry] = spec.static_slot_of[static_cast<size_t>(source) * num_experts + choice.expert_ids[entry]];
      }
    }
    return slots;
  }
  if (spec.algorithm == eplb::DispatchAlgorithm::kBalanced) {
    std::vector<int64_t> counts(static_cast<size_t>(spec.num_sources) * num_experts, 0);  // [source][E]
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t source = t / spec.tokens_per_source;
      FULCRUM_CHECK(source < spec.num_sources, "token {} has source {} of {}", t, source, spec.num_sources);
      for (int j = 0; j < top_k; ++j) ++counts[static_cast<size_t>(source) * num_experts + choice.expert_ids[t * top_k + j]];
    }
    eplb::BalancedSplitter splitter(spec.layer_map, num_experts, spec.topo);
    eplb::BalancedDispatch split;
    splitter.split(counts, split);
    eplb::BalancedRouteTable table;
    eplb::build_balanced_route_table(split, spec.num_sources, table);
    std::vector<int64_t> taken(counts.size(), 0);  // entries of (source, expert) already given a slot
    for (int64_t t = 0; t < num_tokens; ++t) {
      const auto source = static_cast<int>(t / spec.tokens_per_source);
      for (int j = 0; j < top_k; ++j) {
        const int32_t e = choice.expert_ids[t * top_k + j];
        slots[static_cast<size_t>(t * top_k + j)] = table.slot(source, e, taken[static_cast<size_t>(source) * num_experts + e]++);
      }
    }
    return slots;
  }
  // Dynamic: the map is rebuilt from the replica index (slots ascending per expert) for the EPLB core's
  // DynamicDispatcher, one dispatcher per source, visited in the engine's entry order.
  std::vector<int32_t> layer_map(static_cast<size_t>(spec.num_slots), -1);
  for (int e = 0; e < num_experts; ++e) {
    for (int r = spec.replica_offsets[e]; r < spec.replica_offsets[e + 1]; ++r) layer_map[spec.replica_slots[r]] = e;
  }
  const eplb::Topology topo{spec.num_slots, 1, 1};  // dispatcher draws ignore GPUs
  std::vector<int> order(static_cast<size_t>(top_k));
  for (int source = 0; source < spec.num_sources; ++source) {
    eplb::DynamicDispatcher dispatcher(layer_map, num_experts, topo, spec.source_streams[source]);
    const int64_t begin = source * spec.tokens_per_source;
    const int64_t end = std::min(num_tokens, begin + spec.tokens_per_source);
    for (int64_t t = begin; t < end; ++t) {
      const int32_t* ids = choice.expert_ids.data() + t * top_k;
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int b) { return ids[a] < ids[b]; });
      for (const int j : order) slots[static_cast<size_t>(t * top_k + j)] = dispatcher.pick(ids[j]);
    }
  }
  return slots;
}

void accumulate_histogram_reference(const RouterChoice& choice, std::span<int64_t> histogram) {
  for (const int32_t e : choice.expert_ids) ++histogram[static_cast<size_t>(e)];
}

SlotLayout slot_layout_reference(std::span<const int32_t> entry_slots, int num_slots) {
  SlotLayout layout;
  layout.counts.assign(static_cast<size_t>(num_slots), 0);
  for (const int32_t s : entry_slots) {
    FULCRUM_CHECK(s >= 0 && s < num_slots, "entry slot {} outside [0, {})", s, num_slots);
    ++layout.counts[static_cast<size_t>(s)];
  }
  layout.offsets.assign(static_cast<size_t>(num_slots) + 1, 0);
  std::partial_sum(layout.counts.begin(), layout.counts.end(), layout.offsets.begin() + 1);
  return layout;
}

float round_bf16(float value) { return bf16_bits_to_f32(f32_to_bf16_bits(value)); }

namespace {

// out [n, N] = bf16(x [n, K] @ w [N, K]^T), fp32 accumulation as the tensor cores.
std::vector<float> matmul_bf16_out(std::span<const float> x, int64_t n, std::span<const float> w, int out_features,
                                   int in_features) {
  std::vector<float> out(static_cast<size_t>(n * out_features));
  parallel_chunks(int64_t{out_features}, n * in_features, [&](int64_t o_begin, int64_t o_end) {
    for (int64_t r = 0; r < n; ++r) {
      const float* xr = x.data() + r * in_features;
      for (int64_t o = o_begin; o < o_end; ++o) {
        const float* wr = w.data() + o * in_features;
        float sum = 0.0f;
        for (int i = 0; i < in_features; ++i) sum += xr[i] * wr[i];
        out[static_cast<size_t>(r * out_features + o)] = round_bf16(sum);
      }
    }
  });
  return out;
}

}  // namespace

std::vector<float> swiglu_expert_reference(std::span<const float> x, int64_t num_rows, std::span<const float> gate_up,
                                           std::span<const float> down, int hidden_size, int intermediate_size) {
  const std::vector<float> h = matmul_bf16_out(x, num_rows, gate_up, 2 * intermediate_size, hidden_size);  // [n, 2I]
  std::vector<float> act(static_cast<size_t>(num_rows * intermediate_size));                              // [n, I]
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int i = 0; i < intermediate_size; ++i) {
      const float gate = h[static_cast<size_t>(r * 2 * intermediate_size + i)];
      const float up = h[static_cast<size_t>(r * 2 * intermediate_size + intermediate_size + i)];
      act[static_cast<size_t>(r * intermediate_size + i)] = round_bf16(gate / (1.0f + std::exp(-gate)) * up);
    }
  }
  return matmul_bf16_out(act, num_rows, down, hidden_size, intermediate_size);  // [n, H]
}

std::vector<float> combine_reference(std::span<const float> rows, std::span<const int32_t> entry_row,
                                     std::span<const float> weights, int64_t num_tokens, int top_k, int hidden_size) {
  std::vector<float> out(static_cast<size_t>(num_tokens * hidden_size), 0.0f);  // [T, H]
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* o = out.data() + t * hidden_size;
    for (int j = 0; j < top_k; ++j) {
      const float w = weights[static_cast<size_t>(t * top_k + j)];
      const float* row = rows.data() + static_cast<int64_t>(entry_row[static_cast<size_t>(t * top_k + j)]) * hidden_size;
      for (int c = 0; c < hidden_size; ++c) o[c] += w * row[c];
    }
  }
  return out;
}

std::vector<float> moe_layer_reference(std::span<const float> x, std::span<const float> logits, int64_t num_tokens,
                                       std::span<const float> gate_up, std::span<const float> down, int hidden_size,
                                       int intermediate_size, int top_k, bool norm_topk_prob,
                                       const ReplicaChoiceSpec& spec) {
  const RouterChoice choice = route_reference(logits, num_tokens, spec.num_logical_experts, top_k, norm_topk_prob);
  const std::vector<int32_t> slots = choose_slots_reference(choice, spec);
  const SlotLayout layout = slot_layout_reference(slots, spec.num_slots);
  // Entries of each slot in entry order; any order gives the same rows.
  std::vector<int32_t> entry_row(slots.size());
  std::vector<int32_t> fill(layout.offsets.begin(), layout.offsets.end() - 1);
  for (size_t e = 0; e < slots.size(); ++e) entry_row[e] = fill[static_cast<size_t>(slots[e])]++;
  const int64_t num_entries = static_cast<int64_t>(slots.size());
  std::vector<float> expert_rows(static_cast<size_t>(num_entries * hidden_size));  // [T*k, H] slot-contiguous
  const size_t gate_up_size = static_cast<size_t>(2) * intermediate_size * hidden_size;
  const size_t down_size = static_cast<size_t>(hidden_size) * intermediate_size;
  std::vector<float> xs;
  for (int s = 0; s < spec.num_slots; ++s) {
    const int32_t n = layout.counts[static_cast<size_t>(s)];
    if (n == 0) continue;
    xs.assign(static_cast<size_t>(n) * hidden_size, 0.0f);
    for (size_t e = 0; e < slots.size(); ++e) {
      if (slots[e] != s) continue;
      const int64_t t = static_cast<int64_t>(e) / top_k;
      std::copy_n(x.data() + t * hidden_size, hidden_size,
                  xs.data() + static_cast<int64_t>(entry_row[e] - layout.offsets[static_cast<size_t>(s)]) * hidden_size);
    }
    const std::vector<float> ys =
        swiglu_expert_reference(xs, n, gate_up.subspan(s * gate_up_size, gate_up_size),
                                down.subspan(s * down_size, down_size), hidden_size, intermediate_size);
    std::copy(ys.begin(), ys.end(), expert_rows.begin() + static_cast<int64_t>(layout.offsets[static_cast<size_t>(s)]) * hidden_size);
  }
  return combine_reference(expert_rows, entry_row, choice.weights, num_tokens, top_k, hidden_size);
}

}  // namespace fulcrum::model::moe
