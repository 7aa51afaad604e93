#pragma once
// The parallel layout of the engine: which rank holds which shard, from SGLang-style flags.
//
// The world is tp x pp ranks, world rank = pp_rank * tp + tp_rank. The tp ranks of one pipeline stage:
//   attention  with --enable-dp-attention, dp groups of tp / dp ranks (group d = tp ranks [d * A, (d + 1) * A),
//              A = tp / dp), each serving its own sequences (RankEngine::add_sequence picks the group); otherwise
//              one group of A = tp ranks. Heads are sharded A ways inside a group.
//   experts    ep EP ranks (EP rank r = tp ranks [r * M, (r + 1) * M), M = tp / ep) holding physical slots
//              [r * P / ep, (r + 1) * P / ep) of every MoE layer (eplb::Topology{P, ep, 1}: a "GPU" is an
//              EP rank); each of the M ranks holds 1 / M of every expert's moe_intermediate_size.
//   tokens     a group's tokens are split in A contiguous chunks; tp rank d * A + a originates chunk a in
//              the MoE exchange (its "source"), and all tp ranks take part in it, even with no token.
// Stages own contiguous layers, as evenly as possible (the first num_hidden_layers % pp stages get one more).
#include <string>
#include <vector>

#include "model/model_parallel.hpp"
#include "model/qwen3_config.hpp"
#include "model/qwen3_moe.hpp"

namespace fulcrum::engine {

struct ParallelFlags {
  int tp = 1;                        // --tp: ranks per pipeline stage, every attention-DP group included (SGLang's)
  int dp = 1;                        // --dp: attention data-parallel groups (needs --enable-dp-attention when > 1)
  int ep = 1;                        // --ep: expert-parallel ranks per stage
  int pp = 1;                        // --pp: pipeline stages
  bool enable_dp_attention = false;  // --enable-dp-attention
  int num_redundant_experts = 0;     // --ep-num-redundant-experts: R, P = num_experts + R slots per MoE layer
};

// Where one world rank sits.
struct RankCoords {
  int world_rank = 0;
  int pp_rank = 0;
  int tp_rank = 0;       // rank inside its stage
  int attn_dp_rank = 0;  // attention data-parallel group
  int attn_tp_rank = 0;  // rank inside that group
  int ep_rank = 0;
  int moe_tp_rank = 0;   // rank among the M sharing one EP rank's slots
};

class ParallelLayout {
 public:
  // Validates the flags against the model; an impossible layout throws fulcrum::Error
  // with one line saying why.
  ParallelLayout(const ParallelFlags& flags, const model::Qwen3MoeConfig& config);

  const ParallelFlags& flags() const { return flags_; }
  int world_size() const { return flags_.tp * flags_.pp; }
  int tp() const { return flags_.tp; }
  int pp() const { return flags_.pp; }
  int ep() const { return flags_.ep; }
  int attn_dp_size() const { return attn_dp_; }             // D (1 without --enable-dp-attention)
  int attn_tp_size() const { return flags_.tp / attn_dp_; } // A
  int moe_tp_size() const { return flags_.tp / flags_.ep; } // M
  int num_physical_experts() const { return num_physical_experts_; }  // P (0 for a dense-only model)

  RankCoords coords(int world_rank) const;
  model::StageRange stage(int pp_rank) const { return stages_.at(static_cast<size_t>(pp_rank)); }
  model::ShardSpec shard(int world_rank) const;

  // "tp 8 (attention: 2 DP groups x 4 TP), ep 8 (1 rank per EP rank), pp 1 [0,48), 136 slots per MoE layer".
  std::string describe() const;

 private:
  ParallelFlags flags_;
  int attn_dp_ = 1;
  int num_physical_experts_ = 0;
  std::vector<model::StageRange> stages_;
};

}  // namespace fulcrum::engine
