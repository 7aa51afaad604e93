#include "engine/parallel_layout.hpp"

#include <fmt/format.h>

#include "eplb/error.hpp"
#include "eplb/topology.hpp"

namespace fulcrum::engine {

ParallelLayout::ParallelLayout(const ParallelFlags& given, const model::Qwen3MoeConfig& config) : flags_(given) {
  const ParallelFlags& flags = flags_;
  FULCRUM_CHECK(flags.tp >= 1 && flags.dp >= 1 && flags.ep >= 1 && flags.pp >= 1,
                "--tp, --dp, --ep and --pp must be positive (got {}, {}, {}, {})", flags.tp, flags.dp, flags.ep,
                flags.pp);
  FULCRUM_CHECK(flags.dp == 1 || flags.enable_dp_attention,
                "--dp {} needs --enable-dp-attention (data-parallel replicas of the whole model are not supported)",
                flags.dp);
  attn_dp_ = flags.enable_dp_attention ? flags.dp : 1;
  FULCRUM_CHECK(flags.tp % attn_dp_ == 0, "--tp {} is not divisible by --dp {}", flags.tp, attn_dp_);
  FULCRUM_CHECK(flags.ep <= flags.tp,
                "--ep {} exceeds --tp {}: --tp is the ranks of a stage, every attention-DP group included (SGLang's "
                "meaning: --tp 8 --dp 2 --enable-dp-attention is 8 ranks in 2 groups of 4)",
                flags.ep, flags.tp);
  FULCRUM_CHECK(flags.tp % flags.ep == 0, "--tp {} is not divisible by --ep {}", flags.tp, flags.ep);
  FULCRUM_CHECK(flags.pp <= config.num_hidden_layers, "--pp {} exceeds the model's {} layers", flags.pp,
                config.num_hidden_layers);
  const int a = attn_tp_size();
  FULCRUM_CHECK(config.num_attention_heads % a == 0,
                "num_attention_heads {} is not divisible by the attention TP size {} (--tp {} / --dp {})",
                config.num_attention_heads, a, flags.tp, attn_dp_);
  const int kv = config.num_key_value_heads;
  FULCRUM_CHECK(kv >= a ? kv % a == 0 : a % kv == 0,
                "num_key_value_heads {} can be neither split nor evenly replicated over the attention TP size {}", kv,
                a);
  const bool has_moe = !config.moe_layer_indices().empty();
  const bool has_dense = config.moe_layer_indices().size() < static_cast<size_t>(config.num_hidden_layers);
  if (has_dense) {
    FULCRUM_CHECK(config.intermediate_size % a == 0,
                  "intermediate_size {} (dense layers) is not divisible by the attention TP size {}",
                  config.intermediate_size, a);
  }
  FULCRUM_CHECK(flags.num_redundant_experts >= 0, "--ep-num-redundant-experts must not be negative, got {}",
                flags.num_redundant_experts);
  if (has_moe) {
    // eplb::Topology's bound (at most 64 slots per logical expert), checked before the sum can overflow.
    FULCRUM_CHECK(flags.num_redundant_experts <=
                      int64_t{eplb::Topology::kMaxReplicasPerExpert - 1} * config.num_experts,
                  "--ep-num-redundant-experts {} is more than {} x the {} experts", flags.num_redundant_experts,
                  eplb::Topology::kMaxReplicasPerExpert - 1, config.num_experts);
    num_physical_experts_ = config.num_experts + flags.num_redundant_experts;
    FULCRUM_CHECK(num_physical_experts_ % flags.ep == 0,
                  "{} physical experts per MoE layer ({} + {} redundant) are not divisible by --ep {}",
                  num_physical_experts_, config.num_experts, flags.num_redundant_experts, flags.ep);
    FULCRUM_CHECK(config.moe_intermediate_size % moe_tp_size() == 0,
                  "moe_intermediate_size {} is not divisible by the {} ranks sharing each EP rank (--tp {} / --ep {})",
                  config.moe_intermediate_size, moe_tp_size(), flags.tp, flags.ep);
  } else {
    FULCRUM_CHECK(flags.num_redundant_experts == 0, "--ep-num-redundant-experts {} given, but the model has no MoE layer",
                  flags.num_redundant_experts);
  }
  const int base = config.num_hidden_layers / flags.pp, extra = config.num_hidden_layers % flags.pp;
  int start = 0;
  for (int s = 0; s < flags.pp; ++s) {
    const int count = base + (s < extra ? 1 : 0);
    stages_.push_back(model::StageRange{start, start + count});
    start += count;
  }
}

RankCoords ParallelLayout::coords(int world_rank) const {
  FULCRUM_CHECK(world_rank >= 0 && world_rank < world_size(), "rank {} outside a world of {}", world_rank,
                world_size());
  RankCoords c;
  c.world_rank = world_rank;
  c.pp_rank = world_rank / flags_.tp;
  c.tp_rank = world_rank % flags_.tp;
  c.attn_dp_rank = c.tp_rank / attn_tp_size();
  c.attn_tp_rank = c.tp_rank % attn_tp_size();
  c.ep_rank = c.tp_rank / moe_tp_size();
  c.moe_tp_rank = c.tp_rank % moe_tp_size();
  return c;
}

model::ShardSpec ParallelLayout::shard(int world_rank) const {
  const RankCoords c = coords(world_rank);
  return model::ShardSpec{attn_tp_size(), c.attn_tp_rank, flags_.ep, c.ep_rank, moe_tp_size(), c.moe_tp_rank};
}

std::string ParallelLayout::describe() const {
  std::string stages;
  for (const auto& s : stages_) stages += fmt::format(" [{},{})", s.start_layer, s.end_layer);
  return fmt::format("tp {} (attention: {} DP group(s) x {} TP), ep {} ({} rank(s) per EP rank), pp {}:{}, {} slots per "
                     "MoE layer",
                     flags_.tp, attn_dp_, attn_tp_size(), flags_.ep, moe_tp_size(), flags_.pp, stages,
                     num_physical_experts_);
}

}  // namespace fulcrum::engine
