#pragma once
// Expert skinny GEMMs for small MoE steps (decode batches): the rows of each expert slot times that slot's
// weights, with the group sizes and the list of slots that got rows read on the device (capture-safe), bf16
// operands (uint16_t bits), fp32 accumulation, bf16 output. Memory-bound like the dense skinny GEMM
// (skinny_gemm.hpp, the same dot products: skinny_gemm_core.cuh): each used slot's weights are read once, 8 rows
// at a time. CPU reference: src/gpu/reference/skinny_gemm_reference.hpp per slot.
//
//   gate_up + SwiGLU  out [r, j] = bf16(silu(g) * u), g = bf16(x_r . W[j]), u = bf16(x_r . W[I + j]) for
//                     W = weights[slot] [2I, k] (gate rows, then up rows): the two GEMM outputs are rounded to
//                     bf16 as the unfused path stores them, and never leave the chip.
//   plain             out [r, j] = bf16(x_r . W[j]), W = weights[slot] [n, k].
//
// Rows: slot s owns permuted rows [offsets[s], offsets[s + 1]); row r reads x row row_source[r] (a token: no
// permuted copy of x is made) or x row r when row_source is null. active = [count, slot...]: the slots with
// rows, any order. Each row's result is the same whatever the slot's row count and the other slots (the
// arithmetic is per row), and the K split depends only on n, k and max_rows: expert outputs do not depend on
// the placement.
//
// Capture-safe: no allocation, no synchronization; the grid depends on n, k, max_rows, num_slots and the device.
// Returns cudaErrorInvalidValue for n < 1, k <= 0, k % 8 != 0, max_rows < 1, num_slots < 1, x or out misaligned,
// null arrays.
// Weight pointers must be 16-byte aligned (the slot pool's are). With fp8_weights set (and weights null) the
// weights are e4m3 with 128x128 block scales (fields below).
#include <cstdint>

#include <cuda_runtime.h>

#include "gpu/kernels/skinny_gemm.hpp"

namespace fulcrum::gpu {

struct ExpertSkinnyArgs {
  const uint16_t* x = nullptr;               // [*, k] bf16 rows
  const int32_t* row_source = nullptr;       // [rows] x row of each permuted row, or null (row r reads x row r)
  const int32_t* offsets = nullptr;          // [P + 1] permuted row range of each slot
  const int32_t* active = nullptr;           // [1 + max_active]: how many slots have rows, then those slots
  const uint16_t* const* weights = nullptr;  // [P] device pointers: [2n, k] (swiglu) or [n, k]
  int n = 0;                                 // output columns (swiglu: the intermediate size I)
  int k = 0;
  int max_rows = 0;                          // rows over all slots (T x top-k); bounds active and the K split
  int num_slots = 0;                         // P (also bounds active)
  int max_slot_rows = 0;                     // rows one slot can hold at most (a token's entries go to distinct
                                             // slots: the token count), 0 = max_rows; picks the kernel variant
                                             // (registers), never changes a result; any slot may exceed it
  bool swiglu = false;
  // offsets and active were written before the kernel launched just before this one (the down GEMM, launched
  // right after the gate_up one): the kernel may then read them, and load its first weights, before it waits
  // for that kernel (programmatic dependent launch). bf16 weights only; FULCRUM_SKINNY_EARLY_W=0 ignores it.
  bool plan_ready_early = false;
  // How bf16 weights reach the warps (skinny_gemm.hpp's choice): kAuto bulk copies into shared memory for the down
  // GEMM of slots of 2+ rows where an item's rows fit, register loads otherwise (expert_skinny_gemm.cu, measured;
  // FULCRUM_EXPERT_SKINNY_BULK overrides it); kRegisters / kBulk either always. The same bits whichever.
  SkinnyWeightLoads loads = SkinnyWeightLoads::kAuto;
  uint16_t* out = nullptr;                   // [rows, n] bf16, permuted row order
  // FP8 weights (an FP8 checkpoint's experts, weights then null): per slot e4m3 [w_rows, k] (w_rows = 2n with
  // swiglu, else n) and fp32 block scales [k / 128][w_rows / 128] (the FP8 grouped GEMM's layout,
  // grouped_gemm_fp8.hpp): W[j][c] = float(q[j][c]) * scale[c / 128][j / 128], then the same dot products in
  // fp32 with the bf16 x rows (no activation quantization). Needs n % 128 == 0 and k % 128 == 0.
  const uint8_t* const* fp8_weights = nullptr;  // [P]
  const float* const* fp8_scales = nullptr;     // [P]
};

cudaError_t launch_expert_skinny_gemm(const ExpertSkinnyArgs& args, cudaStream_t stream);

}  // namespace fulcrum::gpu
