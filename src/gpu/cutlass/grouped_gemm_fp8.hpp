#pragma once
// FP8 (e4m3) grouped GEMM with blockwise scales for the MoE expert stage of FP8 checkpoints (CUTLASS 4.2 SM90
// ptr-array TMA warp-specialized FP8 blockwise kernels, grouped_gemm_fp8*.cu; CUTLASS example 68 and the
// project's probe ../shared/examples/kernel-probe/gg_kernels.cu). Capture-safe like the bf16 one
// (grouped_gemm.hpp): group sizes are read from DEVICE memory by a setup kernel.
//
// Group g is rows [offsets[g], offsets[g + 1]) of the e4m3 activations a [rows, K]; with Kb = K / 128:
//   d[r][n] = bf16( sum_kb  sa(r, kb) * sb_g[kb][n / 128] * sum_{k in block kb} a[r][k] * b_g[n][k] )
// fp32 accumulation, promoted into the fp32 accumulator once per 128-wide k block (CUTLASS's blockwise
// mainloop), round to nearest even. b_g = b[g % num_b], e4m3 [N, K] row-major (K contiguous), its scales
// b_scales[g % num_b] fp32 [Kb][N / 128] (N blocks contiguous: CUTLASS's MN-major SFB). The activation scales
// of group g (first row f = offsets[g], m rows) lie at a_scales + f * Kb as [Kb][m], m contiguous:
//   sa(r, kb) = a_scales[f * Kb + kb * m + (r - f)]            (CUTLASS's MN-major SFA per group)
// gpu/kernels/fp8_quant.hpp writes activations and scales in exactly this layout.
//
// Shape rule: N % 128 == 0 and K % 128 == 0 (whole scale blocks; the GPU engine pads the expert intermediate
// size to a multiple of 128 with zero weights, so partial checkpoint blocks become whole ones), a, d, every b
// pointer 16-byte aligned, every scale pointer 4-byte aligned. fp8_grouped_gemm_shape_problem says why not.
//
// Placement invariance as in grouped_gemm.hpp: no split-K, each output tile's k loop in order, a row's bits
// depend only on its own a row and scales, its group's b and the config; configs chosen by total rows only.
// CPU reference: gpu::reference::fp8_grouped_gemm (src/gpu/reference/fp8_reference.hpp).
#include <cstddef>
#include <cstdint>

#include "gpu/cutlass/grouped_gemm.hpp"  // GroupedGemmStatus

struct CUstream_st;

namespace fulcrum::gpu {

enum class Fp8GroupedGemmConfig : int {
  kPingpong64x128x128 = 0,
  kCooperative128x128x128 = 1,
  kSwapCooperative128x16x128 = 2,  // swapped operands (grouped_gemm_fp8.cuh kSwapAB): a group's rows on a 16-wide N
  kSwapCooperative128x32x128 = 3,  // or 32-wide N tile, the weights' rows on the 128-row M side
};
constexpr int kNumFp8GroupedGemmConfigs = 4;
// Total rows from which the cooperative config is used. Measured on one H200 (`bench moe` times both configs,
// bench/results/moe_fp8_sweep_h200.json): pingpong wins by 8-12% at 2048 rows, the two are within 2% at 8192,
// cooperative wins by 3-9% at 16384 and by 6-16% at 65536-262144.
constexpr int64_t kFp8GroupedGemmCooperativeMinRows = 16384;

// Total rows up to which the swapped 128x32x128 config is used (decode steps of up to 256 tokens of top-8).
// Measured on one H100 (bench/results/fp8_small_gemm_configs_sweep_*_998523e_h100.json, 30B-A3B FP8 decode,
// context 512, all 48 layers forced per value): 3,3 against the pingpong default 1.1% faster at batch 16, 1.4% at
// 64 and 0.9% at 256; `bench moe` (moe_fp8_configs_998523e_h100.json) has it 0.7-1.6% ahead at 512 and 2048 rows
// for both shapes and behind from 8192, but at 128 rows of the 30B shape behind pingpong (0.192 vs 0.163 ms) where
// the whole decode step was faster. The 16-wide swap was within 0.7% of it at 16 / 64 and lost 3.6% at 256.
constexpr int64_t kFp8GroupedGemmSwapMaxRows = 2048;

inline Fp8GroupedGemmConfig fp8_grouped_gemm_config_for_rows(int64_t total_rows) {
  if (total_rows <= kFp8GroupedGemmSwapMaxRows) return Fp8GroupedGemmConfig::kSwapCooperative128x32x128;
  return total_rows >= kFp8GroupedGemmCooperativeMinRows ? Fp8GroupedGemmConfig::kCooperative128x128x128
                                                         : Fp8GroupedGemmConfig::kPingpong64x128x128;
}

// The config's name in bench JSON, test traces and the FULCRUM_FP8_*GEMM_CONFIGS switches' docs.
inline const char* fp8_grouped_gemm_config_name(Fp8GroupedGemmConfig config) {
  switch (config) {
    case Fp8GroupedGemmConfig::kPingpong64x128x128: return "pingpong_64x128x128";
    case Fp8GroupedGemmConfig::kCooperative128x128x128: return "cooperative_128x128x128";
    case Fp8GroupedGemmConfig::kSwapCooperative128x16x128: return "swap_cooperative_128x16x128";
    case Fp8GroupedGemmConfig::kSwapCooperative128x32x128: return "swap_cooperative_128x32x128";
  }
  return "unknown";
}

constexpr int kFp8BlockSize = 128;

// Null when D [rows, N] = A [rows, K] B^T can run here in FP8, else the reason.
inline const char* fp8_grouped_gemm_shape_problem(int n, int k) {
  if (n <= 0 || k <= 0) return "N and K must be positive";
  if (k % kFp8BlockSize != 0) return "K must be a multiple of 128 (whole 128-wide scale blocks)";
  if (n % kFp8BlockSize != 0) return "N must be a multiple of 128 (whole 128-row weight scale blocks)";
  return nullptr;
}

struct Fp8GroupedGemmLimits {
  int device = -1;
  int sm_count = 0;
  int max_active_clusters[kNumFp8GroupedGemmConfigs] = {};
  int max_groups = 0;
  size_t cutlass_workspace_bytes = 0;
  size_t workspace_bytes = 0;  // CUTLASS's part, then the per-group arrays (shapes, pointers, strides, scale layouts)
};

// Kernel attributes, SM count, cluster occupancy, can_implement and workspace size for up to max_groups
// groups on `device`. Host only; never inside a capture.
GroupedGemmStatus prepare_fp8_grouped_gemm(int device, int max_groups, Fp8GroupedGemmLimits* limits);

struct Fp8GroupedGemmArgs {
  const uint8_t* a = nullptr;              // [rows, K] e4m3 row-major
  const float* a_scales = nullptr;         // per group [Kb][m] at a_scales + offsets[g] * Kb (see above)
  const int32_t* offsets = nullptr;        // [num_groups + 1] absolute first rows, non-decreasing
  int num_groups = 0;                      // <= limits.max_groups; 0: nothing runs
  const uint8_t* const* b = nullptr;       // [num_b] device pointers to e4m3 [N, K]
  const float* const* b_scales = nullptr;  // [num_b] device pointers to fp32 [Kb][N / 128]
  int num_b = 0;
  uint16_t* d = nullptr;                   // [rows, N] bf16 row-major; rows outside every group untouched
  int n = 0;
  int k = 0;
};

// Setup kernel + GEMM on `stream`; no allocation, no host synchronization, no host read of device data.
GroupedGemmStatus run_fp8_grouped_gemm(const Fp8GroupedGemmArgs& args, Fp8GroupedGemmConfig config,
                                       const Fp8GroupedGemmLimits& limits, void* workspace, CUstream_st* stream);

}  // namespace fulcrum::gpu
