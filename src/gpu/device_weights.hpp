#pragma once
// Every weight of a Qwen3-MoE model resident on one GPU: the non-expert tensors in one bf16 allocation (and, for
// FP8 checkpoints, one FP8 allocation), the routed experts in a backend::GpuSlotPool (so EPLB migrates them by
// remapping slot buffers). Filled from a Hugging Face checkpoint (either config convention, sharded or not:
// model::Checkpoint) or, for benchmarks, with pseudo-random values generated on the device (speed does not depend
// on the values).
//
// Layouts (row-major, bf16 bits):
//   qkv [(Hq + 2 Hkv) * D, H]: q_proj rows, then k_proj, then v_proj (one GEMM for all three)
//   o [H, Hq * D]; norms [H] / [D]; dense gate_up [2 I, H] (gate rows, then up rows), down [H, I]
//   router [E, H]; experts per slot gate_up [2 I_moe, H], down [H, I_moe] (the slot pool's layout)
// FP8 checkpoints (config.quantization, hidden size a multiple of 128):
// - the experts stay FP8 on the device, e4m3 codes and their 128x128 block scales in the slot pool's FP8 blobs,
//   with the intermediate size padded to a multiple of 128 by zero rows (gate, up) and columns (down), so every
//   scale block is whole: the padded model computes exactly the same function.
// - with fp8_dense_gemms (GpuEngineOptions::fp8_dense_gemms, off by default: on one H200 the FP8 dense GEMMs are
//   slower than the bf16 ones from 8 rows, docs/benchmarks.md "FP8 dense projections"), the dense projections
//   qkv, o and a dense layer's gate_up / down stay FP8 too (fp8_dense_for), in the layouts
//   above as e4m3 codes with fp32 scales [in / 128][out / 128] (the checkpoint's weight_scale_inv transposed:
//   gpu/fp8_weight.hpp), in LayerWeights' *_fp8 views (their bf16 pointers null). Only where every dimension
//   and every concatenation seam falls on a 128 boundary: the FP8 grouped GEMM of prefill steps takes whole
//   scale blocks only, and a block of qkv's scales must not straddle q and k rows. So qkv needs Hq * D and
//   Hkv * D multiples of 128, o Hq * D, the dense MLP I; a projection that misses is dequantized to bf16 (no
//   padding of the dense MLP, unlike the experts: Qwen3-MoE checkpoints have few or no dense layers).
// - everything else (router, embeddings, norms, LM head) is dequantized to bf16 (W = fp8 x scale_inv, rounded
//   once). An FP8 checkpoint whose hidden size is not a multiple of 128 loads all weights dequantized.
// No CUDA header here.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <memory>
#include <span>
#include <vector>

#include "gpu/fp8_weight.hpp"
#include "gpu/moe/gpu_slot_pool.hpp"
#include "eplb/placement.hpp"
#include "model/checkpoint_writer.hpp"  // TensorSpec
#include "model/qwen3_config.hpp"
#include "model/safetensors.hpp"

namespace fulcrum::comm {
class DeviceExchange;
}  // namespace fulcrum::comm

namespace fulcrum::gpu {

struct LayerWeights {
  int layer_idx = 0;
  int moe_layer_idx = -1;  // -1: a dense MLP layer
  const uint16_t* input_norm = nullptr;
  const uint16_t* post_norm = nullptr;
  const uint16_t* qkv = nullptr;  // null when qkv_fp8 holds it (the same for o, mlp_gate_up, mlp_down)
  const uint16_t* o = nullptr;
  const uint16_t* q_norm = nullptr;
  const uint16_t* k_norm = nullptr;
  const uint16_t* mlp_gate_up = nullptr;  // dense layers
  const uint16_t* mlp_down = nullptr;
  const uint16_t* router = nullptr;       // MoE layers; experts: slot_pool().gate_up_ptrs(moe_layer_idx)
  // FP8 checkpoints (DeviceWeights::fp8_dense_for): the projections kept in FP8, same rows and columns as the
  // bf16 layouts above; absent (codes null) where the projection is bf16.
  Fp8Weight qkv_fp8, o_fp8, mlp_gate_up_fp8, mlp_down_fp8;
};

class DeviceWeights {
 public:
  // Bytes the weights of `config` with `num_slots` expert slots per MoE layer take on the device.
  static int64_t bytes_needed(const model::Qwen3MoeConfig& config, int num_slots, bool fp8_dense_gemms);
  // Whether `config`'s experts stay FP8 on the device, and the intermediate size the slots hold (padded).
  static bool fp8_experts_for(const model::Qwen3MoeConfig& config);
  static int expert_intermediate_for(const model::Qwen3MoeConfig& config);
  // Which dense projections of `config` stay FP8 on the device (all false for a bf16 config or without
  // fp8_dense_gemms; see the file comment for the 128 rule). mlp: only when the model has dense MLP layers.
  struct Fp8Dense {
    bool qkv = false, o = false, mlp = false;
    bool any() const { return qkv || o || mlp; }
  };
  static Fp8Dense fp8_dense_for(const model::Qwen3MoeConfig& config, bool fp8_dense_gemms);

  // Allocates every tensor (contents undefined until a load or fill) for a placement of the MoE layers. Its
  // topology's G GPUs are expert-parallel ranks: this one, `ep_rank`, holds the P / G slots [ep_rank * P / G,
  // (ep_rank + 1) * P / G) of each layer (G = 1: every slot on this GPU), and the whole non-expert model. Throws
  // a one-line error when it does not fit.
  DeviceWeights(const model::Qwen3MoeConfig& config, const eplb::Placement& placement, int device_idx,
                bool fp8_dense_gemms = false, int ep_rank = 0);
  ~DeviceWeights();
  DeviceWeights(const DeviceWeights&) = delete;
  DeviceWeights& operator=(const DeviceWeights&) = delete;

  // Reads every tensor of a checkpoint (the names and shapes the CPU model loads; an unexpected or missing
  // tensor is an error), each expert slot from the logical expert the placement gives it. `on_layer(done,
  // total)` after each decoder layer.
  void load(model::Checkpoint& checkpoint, const std::function<void(int, int)>& on_layer = {});
  // Pseudo-random weights on the device: projections uniform in +-1/sqrt(fan_in), norms 1, experts the slot
  // pool's generated weights (model::expert_weights_reference) of their logical expert. FP8 projections: codes
  // uniform over e4m3's [-448, 448] (cuda::moe::launch_fill_random_e4m3), every block scale 1/sqrt(fan_in) / 448.
  void fill_random(uint64_t seed);

  // The weight cache (`--weight-cache DIR`): every tensor as it lies on the device, in one safetensors file
  // DIR/gpu-rank0/model.safetensors:
  //   bf16 tensors under their checkpoint names (BF16);
  //   FP8 dense projections as "layers.{l}.{qkv|o|mlp_gate_up|mlp_down}.codes" (F8_E4M3 [out, in]) and ".scales"
  //   (F32 [in / 128, out / 128], the device layout);
  //   the experts as each MoE layer's slot array [P, ...]: "slots.{moe layer}.gate_up" / ".down", BF16, or for
  //   FP8 experts F8_E4M3 codes [P, 2 I, H] / [P, H, I] (I padded) with "slots.{moe layer}.gate_up_scales" /
  //   ".down_scales" F32 [P, H / 128, 2 I / 128] / [P, I / 128, H / 128].
  // Every value is stored bit for bit as on the device, so a cache-loaded engine computes the same bits. Its
  // metadata records the config, the placement's slot maps, the format and which weights are FP8 ("weights":
  // "bf16", or "fp8 ...: experts qkv o mlp" naming the FP8 parts; a cache without the key is bf16); load_cache
  // refuses a cache written for another model, placement or weight dtype (one line naming what differs).
  // Loading fills the same buffers load() does, so the slot pool and the layers' slot pointers (EPLB's view)
  // are the ones built at construction on both paths. Written to a temporary name and renamed: never half there.
  static std::string cache_file(const std::string& dir);
  void save_cache(const std::string& dir) const;
  void load_cache(const std::string& dir, const std::function<void(int, int)>& on_layer = {});

  const model::Qwen3MoeConfig& config() const { return config_; }
  const eplb::Placement& placement() const { return placement_; }
  int ep_rank() const { return ep_rank_; }
  // The logical experts of MoE layer `moe_layer`'s slots on this GPU (the placement's row, this rank's part).
  std::span<const int32_t> local_row(int moe_layer) const;
  // Live EPLB: MoE layer `moe_layer`'s slots take new_row (its physical -> logical row, the placement's slot
  // count) by the slot pool's migration, weights and FP8 scales together: on one GPU a local one
  // (GpuSlotPool::migrate_layer_locally); on an EP rank one over `exchange`, the EP ranks' transport, collective
  // (GpuSlotPool::migrate_layer_over). placement() and later cache writes follow. Returns the slots of this GPU that
  // moved. The caller makes sure no queued work reads the layer's old buffers, and points the layer at the new ones.
  int migrate_layer(int moe_layer, std::span<const int32_t> new_row, comm::DeviceExchange* exchange = nullptr);
  const LayerWeights& layer(int layer_idx) const { return layers_[static_cast<size_t>(layer_idx)]; }
  const uint16_t* embedding() const { return embed_; }   // [V, H]
  const uint16_t* final_norm() const { return norm_; }   // [H]
  const uint16_t* lm_head() const { return lm_head_; }   // [V, H] (the embedding when tied)
  backend::GpuSlotPool* slot_pool() { return slots_.get(); }  // null for a model without MoE layers
  const backend::GpuSlotPool* slot_pool() const { return slots_.get(); }
  bool fp8_experts() const { return fp8_experts_for(config_); }
  const Fp8Dense& fp8_dense() const { return fp8_dense_; }
  int expert_intermediate_size() const { return expert_intermediate_for(config_); }
  int64_t bytes() const { return bytes_; }  // every weight on the device, the slot pool's spare layer included

 private:
  struct Entry;  // a checkpoint tensor -> a device region
  std::vector<Entry> entries() const;
  struct Fp8Entry;  // checkpoint FP8 weights stacked by rows -> a device FP8 weight
  std::vector<Fp8Entry> fp8_entries() const;
  std::map<std::string, std::string> cache_identity() const;
  std::string weights_identity() const;
  std::vector<model::TensorSpec> cache_specs() const;  // the cache's tensors, in file order
  // The upload order both loaders share: the embedding / head entries, then each layer's entries and, for a MoE
  // layer, its slot blobs (GpuSlotPool::upload_layer_blobs: bf16 [P, 2I, H] / [P, H, I], or FP8 blobs); a
  // layer's FP8 entries follow its bf16 ones. The callbacks give the bf16 values, the FP8 codes [rows, cols] and
  // scales [cols / 128][rows / 128], and the blobs. Returns when the device holds everything.
  using EntryBits = std::function<void(const Entry&, std::vector<uint16_t>&)>;
  using Fp8Bits = std::function<void(const Fp8Entry&, std::vector<uint8_t>& codes, std::vector<float>& scales)>;
  using SlotBits = std::function<void(int layer_idx, int moe_layer, std::vector<std::byte>& gate_up, std::vector<std::byte>& down)>;
  void upload_in_order(const EntryBits& entry_bits, const Fp8Bits& fp8_bits, const SlotBits& slot_bits,
                       const std::function<void(int, int)>& on_layer);
  static void as_blob(const std::vector<uint16_t>& bits, std::vector<std::byte>& blob);
  // An FP8 checkpoint's experts of one layer (expert_name(slot, "gate_proj" / ...)) as the pool's FP8 blobs.
  void load_fp8_slots(model::Checkpoint& checkpoint, size_t num_slots,
                      const std::function<std::string(size_t, const char*)>& expert_name,
                      std::vector<std::byte>& gate_up, std::vector<std::byte>& down);

  model::Qwen3MoeConfig config_;
  eplb::Placement placement_;
  int device_idx_ = 0;
  int ep_rank_ = 0;
  Fp8Dense fp8_dense_;  // which dense projections this instance holds in FP8
  uint16_t* base_ = nullptr;  // the non-expert bf16 tensors
  std::byte* fp8_base_ = nullptr;  // FP8 dense projections: their device pointer table, then codes and scales
  int64_t bytes_ = 0;
  std::vector<LayerWeights> layers_;
  const uint16_t* embed_ = nullptr;
  const uint16_t* norm_ = nullptr;
  const uint16_t* lm_head_ = nullptr;
  std::unique_ptr<backend::GpuSlotPool> slots_;
};

}  // namespace fulcrum::gpu
