#pragma once
// Row-major out [m, n] = x [m, k] @ w [n, k]^T (bf16 operands, fp32 accumulation, fp32 or bf16 out) through
// cuBLASLt with its first heuristic for the problem. Why not cublasGemmEx's default algorithm: on an H200 the
// first cuBLASLt heuristic was faster at the decode-step projections of 8-128 rows (30B-A3B qkv ~10.4 against
// ~13.1 us, o ~16.4 against ~17.6-21 us, router ~12 against ~14-15 us; tests_cuda/gpu_dense_gemm_lt_timings_test.cpp,
// bench/results/attention_dense_timings_0d2fde1_h200.txt). The first heuristic, not the fastest measured one: a
// choice that does not depend on timings is the same in every run, so outputs are reproducible across runs.
// Plans (descriptors, layouts, the algorithm) are cached per (m, n, k, output type, pointer alignments); a call
// only enqueues on `stream` (capture-safe once its plan exists; finding a plan is host work, no stream touched).
// The workspace is the caller's, used only on the caller's stream. No CUDA header here.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

struct CUstream_st;
struct cublasLtContext;

namespace fulcrum::gpu {

class LtGemm {
 public:
  LtGemm(void* workspace, size_t workspace_bytes);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // Whether FULCRUM_CUBLASLT (read once) leaves this path on; "0" sends callers back to cublasGemmEx (measurement).
  static bool enabled();
  // Enqueues the GEMM; false when cuBLASLt has no algorithm for it (the caller falls back; nothing enqueued).
  bool run(const uint16_t* x, const uint16_t* w, int m, int n, int k, void* out, bool bf16_out, CUstream_st* stream);

 private:
  struct Plan;
  using Key = std::tuple<int, int, int, bool, int, int, int>;  // m, n, k, bf16 out, alignments of x, w, out
  cublasLtContext* handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace fulcrum::gpu
