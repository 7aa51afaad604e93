// Pipeline stages and the expert-slot contract: a stage exposes descriptors only for the MoE layers it
// owns, from construction on (before any weight is read), and loads only its own layers' tensors.
#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.hpp"
#include "model/qwen3_moe.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

const char* const kMix = "qwen3moe-tiny-dense-mix";  // layers 0, 1, 3 MoE (16 experts), layer 2 dense

std::vector<int> view_layers(model::Qwen3MoeModel& m) {
  std::vector<int> layers;
  for (const auto& view : m.expert_slot_views()) layers.push_back(view.layer_idx);
  return layers;
}

TEST(ModelStage, DescriptorsOnlyForOwnedMoeLayers) {
  const auto config = model::load_qwen3_moe_config(golden_model_dir(kMix));
  backend::CpuBackend cpu;
  model::Qwen3MoeModel whole(config, cpu);
  EXPECT_EQ(view_layers(whole), (std::vector<int>{0, 1, 3}));
  model::Qwen3MoeModel middle(config, cpu, {1, 3});
  EXPECT_EQ(view_layers(middle), (std::vector<int>{1}));
  model::Qwen3MoeModel dense_only(config, cpu, {2, 3});
  EXPECT_TRUE(dense_only.expert_slot_views().empty());
  model::Qwen3MoeModel last(config, cpu, {2, 4});
  ASSERT_EQ(view_layers(last), (std::vector<int>{3}));
  EXPECT_EQ(last.expert_slot_views()[0].moe_layer_idx, 2);  // row of the model-wide placement
  EXPECT_FALSE(last.is_first_stage());
  EXPECT_TRUE(last.is_last_stage());
  EXPECT_FALSE(last.owns_layer(1));
}

TEST(ModelStage, DescriptorsExistBeforeLoadingAndStayValid) {
  const auto config = model::load_qwen3_moe_config(golden_model_dir(kMix));
  backend::CpuBackend cpu;
  model::Qwen3MoeModel stage(config, cpu, {0, 2});
  const auto before = stage.expert_slot_views();  // no weight read yet
  ASSERT_EQ(before.size(), 2u);
  for (const auto& view : before) {
    EXPECT_EQ(view.num_slots, 16);
    EXPECT_EQ(view.num_logical_experts, 16);
    EXPECT_EQ(view.gate_up.shape(), (std::vector<int64_t>{16, 2 * 32, 64}));
    EXPECT_EQ(view.down.shape(), (std::vector<int64_t>{16, 64, 32}));
    ASSERT_NE(view.gate_up.data(), nullptr);
    for (int slot = 0; slot < 16; ++slot) EXPECT_EQ(view.physical_to_logical[slot], slot);
  }
  model::Checkpoint checkpoint(golden_model_dir(kMix));
  stage.load_weights(checkpoint);
  const auto after = stage.expert_slot_views();
  for (size_t v = 0; v < after.size(); ++v) {
    // Loading wrote into the memory the early descriptors point at.
    EXPECT_EQ(after[v].gate_up.data(), before[v].gate_up.data());
    EXPECT_EQ(after[v].down.data(), before[v].down.data());
    EXPECT_EQ(after[v].physical_to_logical.data(), before[v].physical_to_logical.data());
    const auto values = cpu.download(before[v].down);
    EXPECT_TRUE(std::any_of(values.begin(), values.end(), [](float x) { return x != 0.0f; }));
  }
}

TEST(ModelStage, TwoStagePipelineEqualsWholeModel) {
  const auto config = model::load_qwen3_moe_config(golden_model_dir(kMix));
  backend::CpuBackend cpu;
  model::Checkpoint checkpoint(golden_model_dir(kMix));
  model::Qwen3MoeModel whole(config, cpu);
  model::Qwen3MoeModel first(config, cpu, {0, 2});
  model::Qwen3MoeModel second(config, cpu, {2, 4});
  whole.load_weights(checkpoint);
  first.load_weights(checkpoint);
  second.load_weights(checkpoint);

  const std::vector<int32_t> prompt_a = {3, 17, 250, 9, 9, 41, 0};
  const std::vector<int32_t> prompt_b = {300};
  model::KvCache whole_a = whole.create_kv_cache(16), whole_b = whole.create_kv_cache(16);
  model::KvCache first_a = first.create_kv_cache(16), first_b = first.create_kv_cache(16);
  model::KvCache second_a = second.create_kv_cache(16), second_b = second.create_kv_cache(16);
  const std::vector<model::SequenceInput> whole_batch = {{prompt_a, &whole_a}, {prompt_b, &whole_b}};
  const std::vector<model::SequenceInput> first_batch = {{prompt_a, &first_a}, {prompt_b, &first_b}};
  const std::vector<model::SequenceInput> second_batch = {{prompt_a, &second_a}, {prompt_b, &second_b}};

  const auto expected = whole.forward(whole_batch);
  const model::Tensor hidden = first.run_layers(first.embed(first_batch), first_batch);  // [8, hidden_size]
  const model::Tensor logits = second.lm_head(second.run_layers(hidden, second_batch));  // [8, vocab_size]
  model::Qwen3MoeModel::commit_tokens(first_batch);
  model::Qwen3MoeModel::commit_tokens(second_batch);
  EXPECT_EQ(cpu.download(logits.rows(0, 7)), cpu.download(expected[0]));
  EXPECT_EQ(cpu.download(logits.rows(7, 1)), cpu.download(expected[1]));
  EXPECT_EQ(first_a.num_tokens, 7);

  EXPECT_NE(error_of([&] { second.embed(second_batch); }).find("not the embedding"), std::string::npos);
  EXPECT_NE(error_of([&] { first.lm_head(hidden); }).find("not the LM head"), std::string::npos);
  EXPECT_NE(error_of([&] { first.forward(first_batch); }).find("owns only layers [0, 2)"), std::string::npos);
}

TEST(ModelStage, InvalidStageOrPlacement) {
  const auto config = model::load_qwen3_moe_config(golden_model_dir(kMix));
  backend::CpuBackend cpu;
  EXPECT_NE(error_of([&] { model::Qwen3MoeModel m(config, cpu, {3, 3}); }).find("[3, 3)"), std::string::npos);
  EXPECT_NE(error_of([&] { model::Qwen3MoeModel m(config, cpu, {0, 5}); }).find("4 layers"), std::string::npos);
  const eplb::Placement wrong_layers = eplb::trivial_placement(eplb::Topology{16, 1, 1}, 4, 16);
  EXPECT_NE(error_of([&] { model::Qwen3MoeModel m(config, cpu, {}, &wrong_layers); }).find("3 MoE layers"),
            std::string::npos);
  eplb::Placement missing_expert = eplb::trivial_placement(eplb::Topology{16, 1, 1}, 3, 16);
  missing_expert.layer(1)[5] = 4;  // expert 5 has no slot
  EXPECT_NE(error_of([&] { model::Qwen3MoeModel m(config, cpu, {}, &missing_expert); }), "");
}

// A copy of the golden checkpoint with `edit` applied to its tensor map.
void write_edited_checkpoint(const TempDir& dir,
                             const std::function<void(std::map<std::string, model::HostTensor>&)>& edit) {
  const model::SafetensorsFile source(golden_model_dir(kMix) + "/model.safetensors");
  std::map<std::string, model::HostTensor> tensors;
  for (const std::string& name : source.names()) tensors[name] = source.read_f32(name);
  edit(tensors);
  model::write_safetensors(dir.file("model.safetensors"), tensors);
}

TEST(ModelStage, LoadErrorsNameTheTensor) {
  const auto config = model::load_qwen3_moe_config(golden_model_dir(kMix));
  backend::CpuBackend cpu;
  const auto load_error = [&](model::StageRange stage, const auto& edit) {
    TempDir dir("ckpt");
    write_edited_checkpoint(dir, edit);
    model::Checkpoint checkpoint(dir.path());
    model::Qwen3MoeModel m(config, cpu, stage);
    return error_of([&] { m.load_weights(checkpoint); });
  };
  using Tensors = std::map<std::string, model::HostTensor>;
  const std::string missing = "model.layers.3.mlp.experts.5.up_proj.weight";
  std::string message = load_error({}, [&](Tensors& t) { t.erase(missing); });
  EXPECT_NE(message.find("missing tensor '" + missing + "'"), std::string::npos) << message;
  // A stage that does not own layer 3 does not need that tensor.
  EXPECT_EQ(load_error({0, 2}, [&](Tensors& t) { t.erase(missing); }), "");
  message = load_error({}, [](Tensors& t) { t["model.layers.9.mlp.gate.weight"] = {{1}, {0}}; });
  EXPECT_NE(message.find("unexpected tensor 'model.layers.9.mlp.gate.weight'"), std::string::npos) << message;
  message = load_error({}, [](Tensors& t) { t["model.layers.2.mlp.experts.0.up_proj.weight"] = {{1}, {0}}; });
  EXPECT_NE(message.find("unexpected tensor"), std::string::npos) << message;  // layer 2 is dense
  message = load_error({}, [](Tensors& t) { t["model.layers.1.mlp.experts.3.down_proj.weight"] = {{32, 64}, std::vector<float>(2048)}; });
  EXPECT_NE(message.find("'model.layers.1.mlp.experts.3.down_proj.weight' has shape [32, 64], expected [64, 32]"),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace fulcrum::test
