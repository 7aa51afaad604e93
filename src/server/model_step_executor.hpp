#pragma once
// StepExecutor over one rank: the whole Qwen3MoeModel on the CPU backend, one KvCache per sequence.
// Routing decisions of every step feed a RoutingCountRecorder (the expert-distribution endpoints).
#include <map>
#include <memory>
#include <string>

#include "backend/cpu/cpu_backend.hpp"
#include "model/qwen3_moe.hpp"
#include "server/expert_distribution.hpp"
#include "server/step_executor.hpp"

namespace fulcrum::server {

class ModelStepExecutor final : public StepExecutor {
 public:
  // Reads config.json and the weights of checkpoint folder `model_dir`.
  explicit ModelStepExecutor(const std::string& model_dir);

  int vocab_size() const override { return model_->config().vocab_size; }
  int64_t max_sequence_length() const override;
  void allocate(SequenceId id, int64_t capacity) override;
  void release(SequenceId id) override;
  std::vector<std::vector<float>> step(std::span<const StepInput> batch) override;

  const model::Qwen3MoeConfig& config() const { return model_->config(); }
  RoutingCountRecorder& recorder() { return *recorder_; }

 private:
  backend::CpuBackend backend_;
  std::unique_ptr<model::Qwen3MoeModel> model_;
  std::unique_ptr<RoutingCountRecorder> recorder_;
  model::ForwardHooks hooks_;
  std::map<SequenceId, model::KvCache> caches_;
};

}  // namespace fulcrum::server
