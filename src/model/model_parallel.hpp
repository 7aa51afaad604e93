#pragma once
// How one rank's Qwen3MoeModel is sharded, and the collective steps it delegates to its engine.
// Without a ModelParallel the model is one rank holding everything (the reference every layout must match).
//
// Shards (src/engine/parallel_layout.hpp derives them from --tp/--dp/--ep):
//   attention   q heads [attn_tp_rank * H/A, +H/A) of num_attention_heads H over the attention TP size A;
//               kv heads sharded the same way when num_key_value_heads >= A, else replicated (A / KV ranks
//               share one kv head); o_proj row-sharded (its input columns), partial sums all-reduced.
//   dense MLP   intermediate_size sharded A ways (gate/up rows, down columns), partial sums all-reduced.
//   experts     physical slots [slot_begin, slot_begin + num_local_slots) of every MoE layer, each expert's
//               moe_intermediate_size sharded moe_tp_size ways; the engine combines partial sums.
//   embedding and LM head: replicated on every rank of the first / last stage.
#include <functional>

#include "model/backend.hpp"

namespace fulcrum::model {

struct ExpertSlotView;

struct ShardSpec {
  int attn_tp_size = 1;  // ranks sharing one attention data-parallel group's heads
  int attn_tp_rank = 0;
  int ep_size = 1;       // expert-parallel ranks: EP rank r holds slots [r * P / ep_size, (r + 1) * P / ep_size)
  int ep_rank = 0;
  int moe_tp_size = 1;   // ranks sharing one EP rank's slots, each holding a slice of moe_intermediate_size
  int moe_tp_rank = 0;
};

class ParallelOps {
 public:
  virtual ~ParallelOps() = default;
  // x [num_tokens, hidden_size] = sum of x over the attention tensor-parallel group (in place).
  virtual void all_reduce_attention(const Tensor& x) = 0;
  // Routed-expert output [num_tokens, hidden_size] of this rank's tokens x [num_tokens, hidden_size] in one
  // MoE layer, given their routing; `layer` holds this rank's slots and the layer's whole slot map.
  virtual Tensor moe_experts(const ExpertSlotView& layer, const Tensor& x, const RouterChoice& choice) = 0;
};

struct ModelParallel {
  ShardSpec shard;
  ParallelOps* ops = nullptr;  // must outlive the model; required when any size above is > 1
};

// One expert's SwiGLU MLP on some rows: xs [n, hidden_size], gate_up [2w, hidden_size] (gate rows, then up
// rows), down [hidden_size, w] -> [n, hidden_size]. w is the slice of moe_intermediate_size held here.
Tensor expert_mlp(Backend& backend, const Tensor& xs, const Tensor& gate_up, const Tensor& down);

}  // namespace fulcrum::model
