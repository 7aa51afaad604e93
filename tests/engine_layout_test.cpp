// ParallelLayout: rank coordinates, stage splits, and impossible layouts refused with one line saying why.
#include <gtest/gtest.h>

#include "engine_test_util.hpp"

namespace fulcrum::test {
namespace {

engine::ParallelFlags make_flags(int tp, int dp, int ep, int pp, int redundant = 0) {
  engine::ParallelFlags f;
  f.tp = tp;
  f.dp = dp;
  f.ep = ep;
  f.pp = pp;
  f.enable_dp_attention = dp > 1;
  f.num_redundant_experts = redundant;
  return f;
}

std::string layout_error(const model::Qwen3MoeConfig& config, const engine::ParallelFlags& flags) {
  return error_of([&] { engine::ParallelLayout layout(flags, config); });
}

TEST(EngineLayout, CoordinatesAndShards) {
  const auto config = model::load_qwen3_moe_config(golden_model_dir(k128e));
  const engine::ParallelLayout layout(make_flags(8, 2, 4, 2), config);
  EXPECT_EQ(layout.world_size(), 16);
  EXPECT_EQ(layout.attn_tp_size(), 4);
  EXPECT_EQ(layout.moe_tp_size(), 2);
  const engine::RankCoords c = layout.coords(13);
  EXPECT_EQ(c.pp_rank, 1);
  EXPECT_EQ(c.tp_rank, 5);
  EXPECT_EQ(c.attn_dp_rank, 1);
  EXPECT_EQ(c.attn_tp_rank, 1);
  EXPECT_EQ(c.ep_rank, 2);
  EXPECT_EQ(c.moe_tp_rank, 1);
  const model::ShardSpec shard = layout.shard(13);
  EXPECT_EQ(shard.attn_tp_size, 4);
  EXPECT_EQ(shard.ep_size, 4);
  EXPECT_EQ(shard.moe_tp_size, 2);
  EXPECT_EQ(layout.stage(0).start_layer, 0);
  EXPECT_EQ(layout.stage(0).end_layer, 2);  // 3 layers over 2 stages: the first takes the extra one
  EXPECT_EQ(layout.stage(1).end_layer, 3);
  EXPECT_EQ(layout.num_physical_experts(), 128);
  // Without --enable-dp-attention, attention is tp-way tensor parallel.
  EXPECT_EQ(engine::ParallelLayout(make_flags(4, 1, 2, 1), config).attn_tp_size(), 4);
}

TEST(EngineLayout, ShardedModelHoldsOnlyItsSlices) {
  const auto config = model::load_qwen3_moe_config(golden_model_dir(kDenseMix));  // 4 q heads, 2 kv heads
  const engine::ParallelLayout layout(make_flags(4, 1, 2, 2, 2), config);
  backend::CpuBackend cpu;
  // A model shard outside an engine still needs ParallelOps for its collectives.
  EXPECT_NE(error_of([&] { model::Qwen3MoeModel m(config, cpu, layout.stage(1), nullptr, {layout.shard(5), nullptr}); })
                .find("needs ParallelOps"),
            std::string::npos);
  comm::run_in_process(8, [&](int rank, comm::Communicator& world) {
    engine::RankEngine engine(config, layout, world, cpu, nullptr, {});
    model::Qwen3MoeModel& m = engine.model();
    EXPECT_EQ(m.num_local_heads(), 1);
    EXPECT_EQ(m.num_local_kv_heads(), 1);  // 2 kv heads over 4 ranks: each pair of ranks shares one
    const auto views = m.expert_slot_views();
    ASSERT_EQ(views.size(), rank < 4 ? 2u : 1u);  // stage 0: layers 0, 1; stage 1: layers 2 (dense), 3
    for (const auto& view : views) {
      EXPECT_EQ(view.num_physical_experts, 18);
      EXPECT_EQ(view.num_slots, 9);
      EXPECT_EQ(view.slot_begin, (rank % 4) / 2 * 9);
      EXPECT_EQ(view.gate_up.shape(), (std::vector<int64_t>{9, 2 * 16, 64}));  // moe_intermediate_size 32 / 2
      EXPECT_EQ(view.down.shape(), (std::vector<int64_t>{9, 64, 16}));
      EXPECT_EQ(view.physical_to_logical.data(), view.layer_map.data() + view.slot_begin);
    }
  });
}

// --tp is SGLang's: the ranks of a stage, every attention-DP group included. --tp 8 --dp 2 is 8 ranks in 2 groups
// of 4; --tp 4 --dp 2 --ep 8 (the attention TP size per group as --tp) is refused, naming the reading.
TEST(EngineLayout, TpIsTheRanksOfAStageAsInSglang) {
  const auto config = model::load_qwen3_moe_config(golden_model_dir(k128e));
  const engine::ParallelLayout sglang(make_flags(8, 2, 8, 1), config);
  EXPECT_EQ(sglang.world_size(), 8);
  EXPECT_EQ(sglang.attn_tp_size(), 4);
  EXPECT_EQ(sglang.attn_dp_size(), 2);
  EXPECT_EQ(sglang.ep(), 8);
  EXPECT_EQ(sglang.coords(5).attn_dp_rank, 1);
  EXPECT_EQ(sglang.coords(5).attn_tp_rank, 1);
  EXPECT_EQ(sglang.coords(5).ep_rank, 5);
  const engine::ParallelLayout dense_moe(make_flags(8, 2, 1, 1), config);  // SGLang's --ep default: 1
  EXPECT_EQ(dense_moe.world_size(), 8);
  EXPECT_EQ(dense_moe.moe_tp_size(), 8);
  EXPECT_EQ(layout_error(config, make_flags(4, 2, 8, 1)),
            "--ep 8 exceeds --tp 4: --tp is the ranks of a stage, every attention-DP group included (SGLang's meaning: "
            "--tp 8 --dp 2 --enable-dp-attention is 8 ranks in 2 groups of 4)");
}

TEST(EngineLayout, ImpossibleLayoutsAreRefusedWithTheReason) {
  const auto config = model::load_qwen3_moe_config(golden_model_dir(k128e));  // 4 heads, 4 kv, 128 experts
  EXPECT_EQ(layout_error(config, make_flags(3, 1, 1, 1)),
            "num_attention_heads 4 is not divisible by the attention TP size 3 (--tp 3 / --dp 1)");
  EXPECT_EQ(layout_error(config, make_flags(4, 1, 3, 1)), "--tp 4 is not divisible by --ep 3");
  EXPECT_EQ(layout_error(config, make_flags(4, 3, 1, 1)), "--tp 4 is not divisible by --dp 3");
  engine::ParallelFlags no_dp_attention = make_flags(4, 2, 1, 1);
  no_dp_attention.enable_dp_attention = false;
  EXPECT_NE(layout_error(config, no_dp_attention).find("--dp 2 needs --enable-dp-attention"), std::string::npos);
  EXPECT_EQ(layout_error(config, make_flags(1, 1, 1, 4)), "--pp 4 exceeds the model's 3 layers");
  EXPECT_EQ(layout_error(config, make_flags(8, 2, 8, 1, 3)),
            "131 physical experts per MoE layer (128 + 3 redundant) are not divisible by --ep 8");
  EXPECT_EQ(layout_error(config, make_flags(32, 32, 1, 1)),
            "moe_intermediate_size 16 is not divisible by the 32 ranks sharing each EP rank (--tp 32 / --ep 1)");
  EXPECT_NE(layout_error(config, make_flags(0, 1, 1, 1)).find("must be positive"), std::string::npos);
  EXPECT_NE(layout_error(config, make_flags(1, 1, 1, 1, -1)).find("must not be negative"), std::string::npos);

  model::Qwen3MoeConfig odd_kv = config;
  odd_kv.num_attention_heads = 6;
  odd_kv.num_key_value_heads = 3;
  EXPECT_EQ(layout_error(odd_kv, make_flags(2, 1, 1, 1)),
            "num_key_value_heads 3 can be neither split nor evenly replicated over the attention TP size 2");
  model::Qwen3MoeConfig dense = model::load_qwen3_moe_config(golden_model_dir(kDenseMix));
  dense.intermediate_size = 130;
  EXPECT_EQ(layout_error(dense, make_flags(4, 1, 4, 1)),
            "intermediate_size 130 (dense layers) is not divisible by the attention TP size 4");
}

TEST(EngineLayout, PlacementMustFitTheModelAndLayout) {
  const auto& f = fixture(kDenseMix);  // 3 MoE layers of 16 experts
  engine::ParallelFlags flags = make_flags(2, 1, 2, 1, 2);
  const eplb::Placement wrong_slots = planned_placement(kDenseMix, 20, 2);
  std::string message = error_of([&] { run_engine(kDenseMix, flags, {}, &wrong_slots); });
  EXPECT_NE(message.find("placement has 3 layers x 20 slots of 16 experts"), std::string::npos) << message;
  EXPECT_NE(message.find("need 3 MoE layers x 18 slots"), std::string::npos) << message;
  // A placement planned for another GPU count is accepted: slots live where this layout puts them.
  const eplb::Placement other_gpus = planned_placement(kDenseMix, 18, 1);
  EXPECT_LE(max_logit_diff(run_engine(kDenseMix, flags, {}, &other_gpus), f.reference), 1e-5f);
  engine::EngineOptions options;
  options.moe_a2a_backend = "nccl";
  message = error_of([&] { run_engine(kDenseMix, flags, options); });
  EXPECT_EQ(message, "unknown --moe-a2a-backend 'nccl' (known: allgather|alltoall)");
}

}  // namespace
}  // namespace fulcrum::test
