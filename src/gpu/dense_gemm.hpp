#pragma once
// The engine's dense GEMMs (attention projections, dense MLP, LM head): row-major out [M, N] = x [M, K] @ W [N, K]^T,
// bf16 operands, fp32 accumulation, fp32 or bf16 output, through cuBLAS on the engine's stream with a fixed
// workspace (so calls can be captured in a CUDA graph). No CUDA header here.
#include <cstdint>

struct CUstream_st;
struct cublasContext;

namespace fulcrum::gpu {

enum class GemmOut { kF32, kBf16 };

class DenseGemm {
 public:
  DenseGemm(CUstream_st* stream, int device_idx);
  ~DenseGemm();
  DenseGemm(const DenseGemm&) = delete;
  DenseGemm& operator=(const DenseGemm&) = delete;

  // The skinny GEMM (kernels/skinny_gemm.hpp) for m <= 8 (default), or cuBLAS for every m (comparisons).
  void set_skinny(bool on) { use_skinny_ = on; }
  // out [m, n] = x [m, k] @ w [n, k]^T; m may be 0.
  void run(const uint16_t* x, const uint16_t* w, int64_t m, int64_t n, int64_t k, void* out, GemmOut out_type);

 private:
  CUstream_st* stream_ = nullptr;
  cublasContext* handle_ = nullptr;
  void* workspace_ = nullptr;
  bool use_skinny_ = true;
};

}  // namespace fulcrum::gpu
