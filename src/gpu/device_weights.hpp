#pragma once
// Every weight of a Qwen3-MoE model resident on one GPU in bf16: the non-expert tensors in one allocation, the
// routed experts in a backend::GpuSlotPool (so EPLB migrates them by remapping slot buffers). Filled from a
// Hugging Face checkpoint (either config convention, sharded or not: model::Checkpoint) or, for benchmarks,
// with pseudo-random values generated on the device (speed does not depend on the values).
//
// Layouts (row-major, bf16 bits):
//   qkv [(Hq + 2 Hkv) * D, H]: q_proj rows, then k_proj, then v_proj (one GEMM for all three)
//   o [H, Hq * D]; norms [H] / [D]; dense gate_up [2 I, H] (gate rows, then up rows), down [H, I]
//   router [E, H]; experts per slot gate_up [2 I_moe, H], down [H, I_moe] (the slot pool's layout)
// FP8 checkpoints (config.quantization, hidden size a multiple of 128): the experts stay FP8 on the device,
// e4m3 codes and their 128x128 block scales in the slot pool's FP8 blobs, with the intermediate size padded to
// a multiple of 128 by zero rows (gate, up) and columns (down), so every scale block is whole: the padded
// model computes exactly the same function. Everything else is dequantized to bf16 (W = fp8 x scale_inv,
// rounded once). An FP8 checkpoint whose hidden size is not a multiple of 128 loads all weights dequantized.
// No CUDA header here.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <memory>
#include <vector>

#include "gpu/moe/gpu_slot_pool.hpp"
#include "eplb/placement.hpp"
#include "model/qwen3_config.hpp"
#include "model/safetensors.hpp"

namespace fulcrum::gpu {

struct LayerWeights {
  int layer_idx = 0;
  int moe_layer_idx = -1;  // -1: a dense MLP layer
  const uint16_t* input_norm = nullptr;
  const uint16_t* post_norm = nullptr;
  const uint16_t* qkv = nullptr;
  const uint16_t* o = nullptr;
  const uint16_t* q_norm = nullptr;
  const uint16_t* k_norm = nullptr;
  const uint16_t* mlp_gate_up = nullptr;  // dense layers
  const uint16_t* mlp_down = nullptr;
  const uint16_t* router = nullptr;       // MoE layers; experts: slot_pool().gate_up_ptrs(moe_layer_idx)
};

class DeviceWeights {
 public:
  // Bytes the weights of `config` with `num_slots` expert slots per MoE layer take on the device.
  static int64_t bytes_needed(const model::Qwen3MoeConfig& config, int num_slots);
  // Whether `config`'s experts stay FP8 on the device, and the intermediate size the slots hold (padded).
  static bool fp8_experts_for(const model::Qwen3MoeConfig& config);
  static int expert_intermediate_for(const model::Qwen3MoeConfig& config);

  // Allocates every tensor (contents undefined until a load or fill) for a placement of the MoE layers
  // (num_physical_experts slots each, all on this GPU). Throws a one-line error when it does not fit.
  DeviceWeights(const model::Qwen3MoeConfig& config, const eplb::Placement& placement, int device_idx);
  ~DeviceWeights();
  DeviceWeights(const DeviceWeights&) = delete;
  DeviceWeights& operator=(const DeviceWeights&) = delete;

  // Reads every tensor of a checkpoint (the names and shapes the CPU model loads; an unexpected or missing
  // tensor is an error), each expert slot from the logical expert the placement gives it. `on_layer(done,
  // total)` after each decoder layer.
  void load(model::Checkpoint& checkpoint, const std::function<void(int, int)>& on_layer = {});
  // Pseudo-random weights on the device: projections uniform in +-1/sqrt(fan_in), norms 1, experts the slot
  // pool's generated weights (model::expert_weights_reference) of their logical expert.
  void fill_random(uint64_t seed);

  // The weight cache (`--weight-cache DIR`): every tensor as it lies on the device, bf16, in one safetensors
  // file DIR/gpu-rank0/model.safetensors, the experts as each MoE layer's slot array [P, ...] under
  // "slots.{moe layer}.gate_up" / ".down" (FP8 experts: not cached yet, a one-line error). Its metadata records the config, the placement's slot maps and the
  // format; load_cache refuses a cache written for another model or placement (one line naming what differs).
  // Loading fills the same buffers load() does, so the slot pool and the layers' slot pointers (EPLB's view)
  // are the ones built at construction on both paths. Written to a temporary name and renamed: never half there.
  static std::string cache_file(const std::string& dir);
  void save_cache(const std::string& dir) const;
  void load_cache(const std::string& dir, const std::function<void(int, int)>& on_layer = {});

  const model::Qwen3MoeConfig& config() const { return config_; }
  const eplb::Placement& placement() const { return placement_; }
  const LayerWeights& layer(int layer_idx) const { return layers_[static_cast<size_t>(layer_idx)]; }
  const uint16_t* embedding() const { return embed_; }   // [V, H]
  const uint16_t* final_norm() const { return norm_; }   // [H]
  const uint16_t* lm_head() const { return lm_head_; }   // [V, H] (the embedding when tied)
  backend::GpuSlotPool* slot_pool() { return slots_.get(); }  // null for a model without MoE layers
  bool fp8_experts() const { return fp8_experts_for(config_); }
  int expert_intermediate_size() const { return expert_intermediate_for(config_); }
  int64_t bytes() const { return bytes_; }  // every weight on the device, the slot pool's spare layer included

 private:
  struct Entry;  // a checkpoint tensor -> a device region
  std::vector<Entry> entries() const;
  std::map<std::string, std::string> cache_identity() const;
  // The upload order both loaders share: the embedding / head entries, then each layer's entries and, for a MoE
  // layer, its slot blobs (GpuSlotPool::upload_layer_blobs: bf16 [P, 2I, H] / [P, H, I], or FP8 blobs); the
  // callbacks give the bf16 values and the blobs.
  using EntryBits = std::function<void(const Entry&, std::vector<uint16_t>&)>;
  using SlotBits = std::function<void(int layer_idx, int moe_layer, std::vector<std::byte>& gate_up, std::vector<std::byte>& down)>;
  void upload_in_order(const EntryBits& entry_bits, const SlotBits& slot_bits, const std::function<void(int, int)>& on_layer);
  static void as_blob(const std::vector<uint16_t>& bits, std::vector<std::byte>& blob);
  // An FP8 checkpoint's experts of one layer (expert_name(slot, "gate_proj" / ...)) as the pool's FP8 blobs.
  void load_fp8_slots(model::Checkpoint& checkpoint, size_t num_slots,
                      const std::function<std::string(size_t, const char*)>& expert_name,
                      std::vector<std::byte>& gate_up, std::vector<std::byte>& down);

  model::Qwen3MoeConfig config_;
  eplb::Placement placement_;
  int device_idx_ = 0;
  uint16_t* base_ = nullptr;  // the non-expert tensors
  int64_t bytes_ = 0;
  std::vector<LayerWeights> layers_;
  const uint16_t* embed_ = nullptr;
  const uint16_t* norm_ = nullptr;
  const uint16_t* lm_head_ = nullptr;
  std::unique_ptr<backend::GpuSlotPool> slots_;
};

}  // namespace fulcrum::gpu
