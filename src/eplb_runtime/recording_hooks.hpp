#pragma once
// Bridges the model's forward hooks to the recorder: each owned MoE layer's routing decision (logical
// expert ids, [num_tokens * top_k]) is recorded under its MoE layer index. The decoder layer -> MoE layer
// map comes from the stage's ExpertSlotViews, so dense layers and other stages' layers are never touched.
#include <functional>
#include <span>

#include "eplb_runtime/expert_recorder.hpp"
#include "model/qwen3_moe.hpp"

namespace fulcrum::eplb_runtime {

// The recorder must outlive the hooks. `next` (optional) is called after recording (hook chaining).
model::ForwardHooks make_recording_hooks(ExpertRecorder& recorder, std::span<const model::ExpertSlotView> views,
                                         model::ForwardHooks next = {});

}  // namespace fulcrum::eplb_runtime
