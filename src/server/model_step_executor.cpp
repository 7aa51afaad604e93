#include "server/model_step_executor.hpp"

#include <algorithm>

#include "eplb/error.hpp"

namespace fulcrum::server {

ModelStepExecutor::ModelStepExecutor(const std::string& model_dir) {
  const model::Qwen3MoeConfig config = model::load_qwen3_moe_config(model_dir);
  model_ = std::make_unique<model::Qwen3MoeModel>(config, backend_);
  model::Checkpoint checkpoint(model_dir);
  model_->load_weights(checkpoint);
  const int num_moe_layers = static_cast<int>(config.moe_layer_indices().size());
  FULCRUM_CHECK(num_moe_layers > 0, "{}: the model has no MoE layer", model_dir);
  recorder_ = std::make_unique<RoutingCountRecorder>(num_moe_layers, config.num_experts);
  hooks_.on_router = [this](int layer_idx, const model::Tensor&, const model::RouterChoice& choice) {
    recorder_->record(model_->config().moe_layer_ordinal(layer_idx), choice.expert_ids, choice.top_k);
  };
}

int64_t ModelStepExecutor::max_sequence_length() const {
  const int n = model_->config().max_position_embeddings;
  return n > 0 ? n : int64_t{1} << 20;
}

void ModelStepExecutor::allocate(SequenceId id, int64_t capacity) {
  FULCRUM_CHECK(!caches_.contains(id), "sequence {} is already allocated", id);
  FULCRUM_CHECK(capacity > 0 && capacity <= max_sequence_length(), "sequence {}: capacity {} outside [1, {}]", id,
                capacity, max_sequence_length());
  caches_.emplace(id, model_->create_kv_cache(capacity));
}

void ModelStepExecutor::release(SequenceId id) { caches_.erase(id); }

std::vector<std::vector<float>> ModelStepExecutor::step(std::span<const StepInput> batch) {
  std::vector<model::SequenceInput> inputs;
  inputs.reserve(batch.size());
  for (const StepInput& in : batch) {
    auto it = caches_.find(in.id);
    FULCRUM_CHECK(it != caches_.end(), "step: sequence {} is not allocated", in.id);
    FULCRUM_CHECK(!in.token_ids.empty(), "step: sequence {} has no new token", in.id);
    FULCRUM_CHECK(it->second.num_tokens + static_cast<int64_t>(in.token_ids.size()) <= it->second.capacity,
                  "step: sequence {} would exceed its capacity {}", in.id, it->second.capacity);
    inputs.push_back(model::SequenceInput{in.token_ids, &it->second});
  }
  const std::vector<model::Tensor> logits = model_->forward(inputs, hooks_);
  const size_t vocab = static_cast<size_t>(model_->config().vocab_size);
  std::vector<std::vector<float>> last(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    std::vector<float> all = backend_.download(logits[i]);
    last[i].assign(all.end() - static_cast<ptrdiff_t>(vocab), all.end());
  }
  return last;
}

}  // namespace fulcrum::server
