#include "eplb_runtime/recording_hooks.hpp"

#include <vector>

namespace fulcrum::eplb_runtime {

model::ForwardHooks make_recording_hooks(ExpertRecorder& recorder, std::span<const model::ExpertSlotView> views,
                                         model::ForwardHooks next) {
  int max_layer_idx = -1;
  for (const auto& view : views) max_layer_idx = std::max(max_layer_idx, view.layer_idx);
  std::vector<int> moe_layer_of(static_cast<size_t>(max_layer_idx + 1), -1);  // decoder layer -> MoE layer
  for (const auto& view : views) {
    FULCRUM_CHECK(recorder.owns_layer(view.moe_layer_idx),
                  "recording hooks: the stage owns MoE layer {} (decoder layer {}) but the recorder does not record it",
                  view.moe_layer_idx, view.layer_idx);
    moe_layer_of[static_cast<size_t>(view.layer_idx)] = view.moe_layer_idx;
  }
  model::ForwardHooks hooks;
  hooks.on_router = [&recorder, moe_layer_of = std::move(moe_layer_of), next = std::move(next)](
                        int layer_idx, const model::Tensor& router_logits, const model::RouterChoice& choice) {
    const bool known = layer_idx >= 0 && layer_idx < static_cast<int>(moe_layer_of.size()) &&
                       moe_layer_of[static_cast<size_t>(layer_idx)] >= 0;
    FULCRUM_CHECK(known, "recording hooks: routing reported for decoder layer {}, which has no expert slot view",
                  layer_idx);
    recorder.record(moe_layer_of[static_cast<size_t>(layer_idx)], choice.expert_ids);
    if (next.on_router) next.on_router(layer_idx, router_logits, choice);
  };
  return hooks;
}

}  // namespace fulcrum::eplb_runtime
