#pragma once
// The engine's dense GEMMs (attention projections, dense MLP, LM head): row-major out [M, N] = x [M, K] @ W [N, K]^T,
// fp32 accumulation, fp32 or bf16 output, on the engine's stream with fixed workspaces (so calls can be captured
// in a CUDA graph).
//   run:     bf16 W, through the skinny GEMM or cuBLAS.
//   run_fp8: FP8 W (an FP8 checkpoint's projections, gpu/fp8_weight.hpp), x still bf16. Up to
//            fp8_skinny_max_rows() rows the FP8 skinny GEMM (bf16 activations, no quantization; one launch per 8
//            rows, the later ones reading the weight mostly from L2); more rows: x quantized per 1x128 block to e4m3
//            (launch_quantize_rows_fp8), then the CUTLASS FP8 blockwise grouped GEMM with one group (the whole
//            batch) into bf16, widened to fp32 where the caller wants fp32 (exact). So prefill rows see two
//            extra roundings against the bf16 engine: e4m3 activations (relative 2^-4 at most) and the bf16
//            GEMM output (2^-9).
// No CUDA header here.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/fp8_weight.hpp"

struct CUstream_st;
struct cublasContext;

namespace fulcrum::gpu {

enum class GemmOut { kF32, kBf16 };

struct Fp8GroupedGemmLimits;

// What run_fp8's quantized path (more than 8 rows) is sized for, fixed at construction: rows (the engine's
// max tokens of a step), the widest K of an FP8 projection (the quantized x [max_rows, max_k] and its scales),
// the widest N with fp32 output (the bf16 GEMM output [max_rows, max_n] before widening). All 0: no FP8 scratch
// and no CUTLASS preparation (a bf16 model); run_fp8 then takes the skinny path only.
struct DenseFp8Capacity {
  int64_t max_rows = 0;
  int64_t max_k = 0;
  int64_t max_n = 0;
};

class DenseGemm {
 public:
  DenseGemm(CUstream_st* stream, int device_idx, const DenseFp8Capacity& fp8 = {});
  ~DenseGemm();
  DenseGemm(const DenseGemm&) = delete;
  DenseGemm& operator=(const DenseGemm&) = delete;

  // The skinny GEMMs for m <= 8 (default), or cuBLAS (bf16) / the quantized CUTLASS path (FP8) for every m
  // (comparisons).
  void set_skinny(bool on) { use_skinny_ = on; }
  // Rows up to which run_fp8 takes the skinny path; above it, the quantized CUTLASS path. 8: measured on one H200
  // (DenseGemmFp8Test.PrintsTimings), the skinny path is faster up to 8 rows at every attention projection of
  // both presets and slower from 9 (235B-A22B qkv) to 24 rows (30B-A3B o).
  static constexpr int64_t kDefaultFp8SkinnyMaxRows = 8;
  void set_fp8_skinny_max_rows(int64_t rows) { fp8_skinny_max_rows_ = rows; }
  int64_t fp8_skinny_max_rows() const { return fp8_skinny_max_rows_; }
  // out [m, n] = x [m, k] @ w [n, k]^T; m may be 0.
  void run(const uint16_t* x, const uint16_t* w, int64_t m, int64_t n, int64_t k, void* out, GemmOut out_type);
  // The same with FP8 weights. Skinny path: k % 16 == 0, x and w 16-byte aligned. Quantized path: n and k
  // multiples of 128 (DeviceWeights keeps every other projection bf16), m <= max_rows, k <= max_k, for fp32 out
  // n <= max_n; x and a bf16 out 16-byte aligned. Anything else: a one-line error. Capture-safe for a fixed m
  // (the group offsets {0, m} come from a table written at construction).
  void run_fp8(const uint16_t* x, const Fp8Weight& w, int64_t m, int64_t n, int64_t k, void* out, GemmOut out_type);

  // Device bytes of the FP8 scratch and workspace (0 without an FP8 capacity).
  int64_t fp8_scratch_bytes() const { return fp8_scratch_bytes_; }

 private:
  void* fp8_alloc(size_t bytes);

  CUstream_st* stream_ = nullptr;
  cublasContext* handle_ = nullptr;
  void* workspace_ = nullptr;
  bool use_skinny_ = true;
  int64_t fp8_skinny_max_rows_ = kDefaultFp8SkinnyMaxRows;

  DenseFp8Capacity fp8_;
  std::vector<void*> fp8_owned_;
  int64_t fp8_scratch_bytes_ = 0;
  std::unique_ptr<Fp8GroupedGemmLimits> fp8_limits_;  // one group
  std::string fp8_unavailable_;  // why the quantized path cannot run here (empty: it can)
  void* fp8_workspace_ = nullptr;
  uint8_t* fp8_x_ = nullptr;          // [max_rows, max_k] e4m3
  float* fp8_x_scales_ = nullptr;     // [max_k / 128][m] for the call's m
  uint16_t* fp8_out_bf16_ = nullptr;  // [max_rows, max_n] the GEMM's bf16 output before widening
  int32_t* row_pairs_ = nullptr;      // [max_rows + 1][2]: {0, m} at 2 m, the offsets of one group of m rows
  int32_t* row_ids_ = nullptr;        // [max_rows] 0, 1, ...: the widening's row map
  float* row_ones_ = nullptr;         // [max_rows] 1.0f: the widening's weights
};

}  // namespace fulcrum::gpu
