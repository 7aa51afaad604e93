// GPU MoE layer, FP8 experts (MoeLayerShape::fp8_experts): slot pointers, the layer's own random experts and
// the CUTLASS path — 1x128 quantization of the permuted rows (fused into the permutation by default:
// cuda::moe::launch_permute_rows_fp8; a separate pass over bf16 rows when that is off and for run_experts_on's
// received rows), FP8 blockwise grouped GEMM gate_up, SwiGLU fused with the quantization of its output, FP8
// grouped GEMM down (gpu/cutlass/grouped_gemm_fp8.hpp, gpu/kernels/fp8_quant.hpp). The skinny path reads the
// same codes and scales (moe_layer.cpp, skinny_gemms).
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "backend/cuda/cuda_check.hpp"
#include "eplb/error.hpp"
#include "gpu/env_switch.hpp"
#include "gpu/kernels/fp8_quant.hpp"
#include "gpu/moe/gpu_slot_pool.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "gpu/moe/moe_layer.hpp"

namespace fulcrum::backend {
namespace {

// Read once. On unless FULCRUM_FP8_FUSED_PERMUTE=0: measured on one H200 (bench/results/moe_fp8_sweep_h200.json),
// the fused permutation takes the same time at 256 tokens and 0.89-0.95x (30B-A3B) / 0.91-0.98x (235B-A22B)
// the unfused layer's at 1024-32768.
bool fp8_fused_permute_by_env() {
  static const bool enabled = gpu::env_switch_on("FULCRUM_FP8_FUSED_PERMUTE");
  return enabled;
}

}  // namespace

bool GpuMoeLayer::fp8_fused_permute() const { return fp8_fused_permute_.value_or(fp8_fused_permute_by_env()); }

bool GpuMoeLayer::permute_quantize_fp8(const uint16_t* x, int64_t num_tokens) {
  // Only where run_experts reads this permutation on CUTLASS: an expert-parallel layer sends the bf16 rows.
  if (!shape_.fp8_experts || !fp8_fused_permute() || shape_.local_slots() != shape_.num_slots || !uses_cutlass() ||
      reinterpret_cast<uintptr_t>(x) % 16 != 0) {
    return false;
  }
  MoeWorkspace& w = ws();
  FULCRUM_CUDA_CHECK(cuda::moe::launch_permute_rows_fp8(
      x, num_tokens, shape_.num_experts_per_tok, shape_.hidden_size, w.slots.as<int32_t>(), w.offsets.as<int32_t>(),
      w.cursor.as<int32_t>(), w.entry_row.as<int32_t>(), w.fp8_x.as<uint8_t>(), w.fp8_x_scales.as<float>(), stream_));
  return true;
}

void GpuMoeLayer::set_fp8_slot_weights(const Fp8SlotPtrs& slots) {
  FULCRUM_CHECK(shape_.fp8_experts, "set_fp8_slot_weights: the layer's experts are bf16 (set_slot_weights)");
  const size_t l = static_cast<size_t>(shape_.local_slots());
  FULCRUM_CHECK(slots.gate_up.size() == l && slots.down.size() == l && slots.gate_up_scales.size() == l &&
                    slots.down_scales.size() == l,
                "set_fp8_slot_weights: {} / {} / {} / {} pointers, expected {} each", slots.gate_up.size(),
                slots.down.size(), slots.gate_up_scales.size(), slots.down_scales.size(), l);
  for (size_t q = 0; q < l; ++q) {
    FULCRUM_CHECK(slots.gate_up[q] != nullptr && slots.down[q] != nullptr && slots.gate_up_scales[q] != nullptr &&
                      slots.down_scales[q] != nullptr,
                  "set_fp8_slot_weights: null pointer for local slot {}", q);
  }
  fp8_slots_ = std::make_unique<Fp8SlotPtrs>(slots);
  has_expert_weights_ = true;
  upload_fp8_slot_pointers();
}

void GpuMoeLayer::upload_fp8_slot_pointers() {
  if (fp8_slots_ == nullptr) {  // external weights not set yet: null pointers, no forward runs (has_expert_weights_)
    slot_pointers_aligned_ = false;
    return;
  }
  const Fp8SlotPtrs& s = *fp8_slots_;
  const size_t l = s.gate_up.size();
  bool aligned = true;
  for (size_t q = 0; q < l; ++q) {
    aligned = aligned && gpu::grouped_gemm_aligned(s.gate_up[q]) && gpu::grouped_gemm_aligned(s.down[q]) &&
              gpu::grouped_gemm_aligned(s.gate_up_scales[q]) && gpu::grouped_gemm_aligned(s.down_scales[q]);
  }
  // Stream-ordered as the bf16 pointers: a forward in flight reads the old ones; then wait for the host vectors.
  const auto upload = [&](DeviceBuffer& dst, const void* src) {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(dst.as<void>(), src, sizeof(void*) * l, cudaMemcpyHostToDevice, stream_));
  };
  upload(gate_up_ptrs_, s.gate_up.data());
  upload(down_ptrs_, s.down.data());
  upload(gate_up_scale_ptrs_, s.gate_up_scales.data());
  upload(down_scale_ptrs_, s.down_scales.data());
  synchronize();
  slot_pointers_aligned_ = aligned;
}

void GpuMoeLayer::randomize_fp8_experts(uint64_t seed) {
  // Local slot l holds the generated weights of "expert" local_slot_begin + l (a function of the global slot,
  // as the bf16 fill), codes and scales through the slot pool's FP8 fill.
  std::vector<int32_t> global(static_cast<size_t>(shape_.local_slots()));
  std::iota(global.begin(), global.end(), shape_.local_slot_begin);
  own_fp8_pool_->fill_layer(0, global, seed);
}

// FULCRUM_FP8_SMALL_GEMM_CONFIGS=U,D (Fp8GroupedGemmConfig values) sets the gate_up and the down GEMM's configs of
// steps below kFp8GroupedGemmCooperativeMinRows rows (decode, small prefill), FULCRUM_FP8_GEMM_CONFIGS=U,D those of
// the larger steps; for measurement (bench/run_gpu_env_sweep.sh). Read once. Unset: `config` for both. Either way
// the choice depends on the total rows only (placement-invariant).
static std::pair<gpu::Fp8GroupedGemmConfig, gpu::Fp8GroupedGemmConfig> fp8_gemm_configs(int64_t total_rows) {
  static const std::pair<int, int> large =
      gpu::env_config_pair("FULCRUM_FP8_GEMM_CONFIGS", gpu::kNumFp8GroupedGemmConfigs);
  static const std::pair<int, int> small =
      gpu::env_config_pair("FULCRUM_FP8_SMALL_GEMM_CONFIGS", gpu::kNumFp8GroupedGemmConfigs);
  const gpu::Fp8GroupedGemmConfig config = gpu::fp8_grouped_gemm_config_for_rows(total_rows);
  const std::pair<int, int>& forced = total_rows >= gpu::kFp8GroupedGemmCooperativeMinRows ? large : small;
  if (forced.first < 0) return {config, config};
  return {static_cast<gpu::Fp8GroupedGemmConfig>(forced.first),
          static_cast<gpu::Fp8GroupedGemmConfig>(forced.second)};
}

void GpuMoeLayer::cutlass_experts_fp8(const uint16_t* in, const int32_t* offsets, int num_groups, int first_local,
                                      int num_weights, int64_t max_rows, int64_t total_rows, uint16_t* out) {
  MoeWorkspace& w = ws();
  FULCRUM_CHECK(max_rows <= w.expert_rows() && max_rows <= shape_.max_tokens * shape_.num_experts_per_tok,
                "FP8 experts: {} rows, scratch for {}", max_rows, w.expert_rows());
  const int h = shape_.hidden_size, i = shape_.moe_intermediate_size;
  auto [up_config, down_config] = fp8_gemm_configs(total_rows);  // placement-free: by total rows
  if (fp8_gemm_config_.has_value()) up_config = down_config = *fp8_gemm_config_;
  const auto check = [](const gpu::GroupedGemmStatus& status, const char* which) {
    FULCRUM_CHECK(status.ok(), "CUTLASS FP8 grouped GEMM ({}): {} ({})", which, status.failed,
                  cudaGetErrorString(static_cast<cudaError_t>(status.cuda_error)));
  };
  if (in != nullptr) {  // else permute_quantize_fp8 wrote fp8_x / fp8_x_scales from x
    FULCRUM_CUDA_CHECK(gpu::launch_quantize_rows_fp8(in, h, offsets, num_groups, max_rows, w.fp8_x.as<uint8_t>(),
                                                     w.fp8_x_scales.as<float>(), stream_));
  }
  gpu::Fp8GroupedGemmArgs gemm;
  gemm.a = w.fp8_x.as<uint8_t>();  // [rows, H]
  gemm.a_scales = w.fp8_x_scales.as<float>();
  gemm.offsets = offsets;
  gemm.num_groups = num_groups;
  gemm.b = gate_up_ptrs_.as<const uint8_t*>() + first_local;  // [2I, H] each
  gemm.b_scales = gate_up_scale_ptrs_.as<const float*>() + first_local;
  gemm.num_b = num_weights;
  gemm.d = w.h.as<uint16_t>();  // [rows, 2I]
  gemm.n = 2 * i;
  gemm.k = h;
  check(gpu::run_fp8_grouped_gemm(gemm, up_config, w.fp8_gemm_limits(), w.fp8_gemm_workspace(), stream_), "gate_up");
  FULCRUM_CUDA_CHECK(gpu::launch_swiglu_quantize_fp8(w.h.as<uint16_t>(), i, offsets, num_groups, max_rows,
                                                     w.fp8_act.as<uint8_t>(), w.fp8_act_scales.as<float>(), stream_));
  gemm.a = w.fp8_act.as<uint8_t>();  // [rows, I]
  gemm.a_scales = w.fp8_act_scales.as<float>();
  gemm.b = down_ptrs_.as<const uint8_t*>() + first_local;  // [H, I] each
  gemm.b_scales = down_scale_ptrs_.as<const float*>() + first_local;
  gemm.d = out;  // [rows, H]
  gemm.n = h;
  gemm.k = i;
  check(gpu::run_fp8_grouped_gemm(gemm, down_config, w.fp8_gemm_limits(), w.fp8_gemm_workspace(), stream_), "down");
}

}  // namespace fulcrum::backend
