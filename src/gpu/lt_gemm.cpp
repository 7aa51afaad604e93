#include "gpu/lt_gemm.hpp"

#include <cublasLt.h>

#include "backend/cuda/cuda_check.hpp"
#include "gpu/env_switch.hpp"

namespace fulcrum::gpu {
namespace {

// The largest power of two <= 256 dividing the address: what the heuristic may assume of the pointer.
int alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && address % static_cast<uintptr_t>(align) != 0) align /= 2;
  return align;
}

}  // namespace

struct LtGemm::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, out = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
  ~Plan() {
    if (out != nullptr) cublasLtMatrixLayoutDestroy(out);
    if (x != nullptr) cublasLtMatrixLayoutDestroy(x);
    if (w != nullptr) cublasLtMatrixLayoutDestroy(w);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

LtGemm::LtGemm(void* workspace, size_t workspace_bytes) : workspace_(workspace), workspace_bytes_(workspace_bytes) {
  FULCRUM_CUBLAS_CHECK(cublasLtCreate(&handle_));
}

LtGemm::~LtGemm() {
  plans_.clear();
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

bool LtGemm::enabled() {
  static const bool on = env_switch_on("FULCRUM_CUBLASLT");
  return on;
}

bool LtGemm::run(const uint16_t* x, const uint16_t* w, int m, int n, int k, void* out, bool bf16_out,
                 CUstream_st* stream) {
  const int align_x = alignment_of(x), align_w = alignment_of(w), align_out = alignment_of(out);
  const Key key{m, n, k, bf16_out, align_x, align_w, align_out};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    // Column-major view, as DenseGemm's cublasGemmEx call: out^T [n, m] = W^T (op T on [k, n]) x x^T [k, m].
    auto plan = std::make_unique<Plan>();
    FULCRUM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t trans_w = CUBLAS_OP_T, trans_x = CUBLAS_OP_N;
    FULCRUM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_w, sizeof(trans_w)));
    FULCRUM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_x, sizeof(trans_x)));
    FULCRUM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->w, CUDA_R_16BF, k, n, k));
    FULCRUM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->x, CUDA_R_16BF, k, m, k));
    FULCRUM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->out, bf16_out ? CUDA_R_16BF : CUDA_R_32F, n, m, n));
    cublasLtMatmulPreference_t pref = nullptr;
    FULCRUM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t workspace = workspace_bytes_;
    const uint32_t a_align = static_cast<uint32_t>(align_w), b_align = static_cast<uint32_t>(align_x),
                   c_align = static_cast<uint32_t>(align_out);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a_align, sizeof(a_align));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &b_align, sizeof(b_align));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &c_align, sizeof(c_align));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &c_align, sizeof(c_align));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle_, plan->op, plan->w, plan->x, plan->out, plan->out, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    plan->found = status == CUBLAS_STATUS_SUCCESS && found > 0;
    if (plan->found) plan->algo = result.algo;
    it = plans_.emplace(key, std::move(plan)).first;
  }
  const Plan& plan = *it->second;
  if (!plan.found) return false;
  const float alpha = 1.0f, beta = 0.0f;
  FULCRUM_CUBLAS_CHECK(cublasLtMatmul(handle_, plan.op, &alpha, w, plan.w, x, plan.x, &beta, out, plan.out, out,
                                      plan.out, &plan.algo, workspace_, workspace_bytes_, stream));
  return true;
}

}  // namespace fulcrum::gpu
