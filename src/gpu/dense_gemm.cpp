#include "gpu/dense_gemm.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include <fmt/format.h>

#include "backend/cuda/cuda_check.hpp"
#include "eplb/error.hpp"
#include "gpu/cutlass/grouped_gemm_fp8.hpp"
#include "gpu/kernels/fp8_quant.hpp"
#include "gpu/kernels/skinny_gemm.hpp"
#include "gpu/moe/moe_kernels.hpp"

namespace fulcrum::gpu {
namespace {
// cuBLAS's recommendation for Hopper is 32 MiB; a captured graph must not make cuBLAS allocate.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
}  // namespace

DenseGemm::DenseGemm(CUstream_st* stream, int device_idx, const DenseFp8Capacity& fp8) : stream_(stream), fp8_(fp8) {
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx));
  FULCRUM_CUBLAS_CHECK(cublasCreate(&handle_));
  FULCRUM_CUBLAS_CHECK(cublasSetStream(handle_, stream_));
  FULCRUM_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
  FULCRUM_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace_, kWorkspaceBytes));
  if (fp8_.max_rows <= 0) {
    fp8_ = {};
    return;
  }
  FULCRUM_CHECK(fp8_.max_k > 0 && fp8_.max_k % kFp8BlockSize == 0 && fp8_.max_n >= 0 && fp8_.max_rows <= INT32_MAX,
                "FP8 dense GEMM: capacity of {} rows, K {}, N {} (K a positive multiple of 128)", fp8_.max_rows,
                fp8_.max_k, fp8_.max_n);
  fp8_limits_ = std::make_unique<Fp8GroupedGemmLimits>();
  const GroupedGemmStatus status = prepare_fp8_grouped_gemm(device_idx, /*max_groups=*/1, fp8_limits_.get());
  if (!status.ok()) {
    // Not an sm_90a device (the CUTLASS kernels are built for it only): the skinny path still runs, the first
    // quantized call fails with this reason (as the FP8 MoE layer does).
    fp8_unavailable_ = fmt::format("CUTLASS FP8 GEMM unavailable: {} ({})", status.failed,
                                   cudaGetErrorString(static_cast<cudaError_t>(status.cuda_error)));
    (void)cudaGetLastError();
    fp8_limits_.reset();
    return;
  }
  const size_t rows = static_cast<size_t>(fp8_.max_rows);
  fp8_workspace_ = fp8_alloc(fp8_limits_->workspace_bytes);
  fp8_x_ = static_cast<uint8_t*>(fp8_alloc(rows * static_cast<size_t>(fp8_.max_k)));
  fp8_x_scales_ = static_cast<float*>(fp8_alloc(sizeof(float) * rows * static_cast<size_t>(fp8_.max_k / kFp8BlockSize)));
  fp8_out_bf16_ = static_cast<uint16_t*>(fp8_alloc(sizeof(uint16_t) * rows * static_cast<size_t>(fp8_.max_n)));
  // Constant tables, written once: the grouped GEMM and the quantization read the group's offsets from device
  // memory, and a pointer into this table depends only on m (fixed for a captured batch).
  std::vector<int32_t> pairs(2 * (rows + 1)), ids(rows);
  for (size_t m = 0; m <= rows; ++m) pairs[2 * m + 1] = static_cast<int32_t>(m);  // pairs[2 m] = 0
  for (size_t r = 0; r < rows; ++r) ids[r] = static_cast<int32_t>(r);
  const std::vector<float> ones(rows, 1.0f);
  row_pairs_ = static_cast<int32_t*>(fp8_alloc(sizeof(int32_t) * pairs.size()));
  row_ids_ = static_cast<int32_t*>(fp8_alloc(sizeof(int32_t) * rows));
  row_ones_ = static_cast<float*>(fp8_alloc(sizeof(float) * rows));
  FULCRUM_CUDA_CHECK(cudaMemcpy(row_pairs_, pairs.data(), sizeof(int32_t) * pairs.size(), cudaMemcpyHostToDevice));
  FULCRUM_CUDA_CHECK(cudaMemcpy(row_ids_, ids.data(), sizeof(int32_t) * rows, cudaMemcpyHostToDevice));
  FULCRUM_CUDA_CHECK(cudaMemcpy(row_ones_, ones.data(), sizeof(float) * rows, cudaMemcpyHostToDevice));
  // A copy from pageable memory may return before its DMA lands, and the engine's non-blocking stream does not
  // wait for the legacy one.
  FULCRUM_CUDA_CHECK(cudaDeviceSynchronize());
}

DenseGemm::~DenseGemm() {
  if (handle_ != nullptr) cublasDestroy(handle_);
  if (workspace_ != nullptr) cudaFree(workspace_);
  for (void* p : fp8_owned_) cudaFree(p);
}

void* DenseGemm::fp8_alloc(size_t bytes) {
  void* p = nullptr;
  FULCRUM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16)));  // cudaMalloc: 256-byte aligned
  fp8_owned_.push_back(p);
  fp8_scratch_bytes_ += static_cast<int64_t>(std::max<size_t>(bytes, 16));
  return p;
}

void DenseGemm::run(const uint16_t* x, const uint16_t* w, int64_t m, int64_t n, int64_t k, void* out, GemmOut out_type) {
  if (m == 0) return;
  // Decode-sized steps where the skinny GEMM beat cuBLAS in tests_cuda/gpu_skinny_gemm_test.cpp's timings on an
  // H200 (one row: QKV 10.8 vs 13.7 us, O 9.3 vs 17.3, router 5.6 vs 13.9, LM head 144 vs 152; up to 8 rows with
  // n <= 2048: O 14.1 vs 17.1 us at m = 8; cuBLAS won QKV and the LM head from 4 rows). A given (m, n) always
  // takes the same path.
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out) % 4 == 0;
  if ((m == 1 || (m <= kSkinnyGemmMaxRows && n <= 2048)) && k % 8 == 0 && aligned && n <= INT32_MAX && k <= INT32_MAX && use_skinny_) {
    const cudaError_t status = launch_skinny_gemm(
        x, w, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
        out_type == GemmOut::kF32 ? static_cast<float*>(out) : nullptr,
        out_type == GemmOut::kBf16 ? static_cast<uint16_t*>(out) : nullptr, stream_);
    FULCRUM_CHECK(status == cudaSuccess, "skinny GEMM [{}, {}] x [{}, {}]^T: {}", m, k, n, k, cudaGetErrorString(status));
    return;
  }
  FULCRUM_CHECK(m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX, "dense GEMM [{}, {}] x [{}, {}]^T too large", m, k, n, k);
  // Row-major out [m, n] is column-major out^T [n, m] = W^T (op T on the column-major [k, n] view of W) x x^T.
  const float alpha = 1.0f, beta = 0.0f;
  FULCRUM_CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                                    static_cast<int>(k), &alpha, w, CUDA_R_16BF, static_cast<int>(k), x, CUDA_R_16BF,
                                    static_cast<int>(k), &beta, out, out_type == GemmOut::kF32 ? CUDA_R_32F : CUDA_R_16BF,
                                    static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void DenseGemm::run_fp8(const uint16_t* x, const Fp8Weight& w, int64_t m, int64_t n, int64_t k, void* out,
                        GemmOut out_type) {
  if (m == 0) return;
  FULCRUM_CHECK(w.codes != nullptr && w.scales != nullptr && m > 0 && n > 0 && k > 0 && n <= INT32_MAX && k <= INT32_MAX,
                "FP8 dense GEMM [{}, {}] x [{}, {}]^T: no FP8 weight or a bad shape", m, k, n, k);
  float* const out_f32 = out_type == GemmOut::kF32 ? static_cast<float*>(out) : nullptr;
  uint16_t* const out_bf16 = out_type == GemmOut::kBf16 ? static_cast<uint16_t*>(out) : nullptr;
  if (use_skinny_ && m <= fp8_skinny_max_rows_) {
    // Decode rows: the weights' bytes dominate, and the skinny kernel reads half of the bf16 ones; x stays bf16.
    // Up to 8 rows a launch: each launch computes its rows as a call with that many rows would.
    for (int64_t r = 0; r < m; r += kSkinnyGemmMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kSkinnyGemmMaxRows, m - r));
      const cudaError_t status = launch_skinny_gemm_fp8(x + r * k, w.codes, w.scales, rows, static_cast<int>(n),
                                                        static_cast<int>(k), out_f32 != nullptr ? out_f32 + r * n : nullptr,
                                                        out_bf16 != nullptr ? out_bf16 + r * n : nullptr, stream_);
      FULCRUM_CHECK(status == cudaSuccess, "FP8 skinny GEMM [{}, {}] x [{}, {}]^T: {}", m, k, n, k,
                    cudaGetErrorString(status));
    }
    return;
  }
  FULCRUM_CHECK(fp8_unavailable_.empty(), "FP8 dense GEMM [{}, {}] x [{}, {}]^T: {}", m, k, n, k, fp8_unavailable_);
  const char* shape_problem = fp8_grouped_gemm_shape_problem(static_cast<int>(n), static_cast<int>(k));
  FULCRUM_CHECK(shape_problem == nullptr, "FP8 dense GEMM [{}, {}] x [{}, {}]^T: {}", m, k, n, k, shape_problem);
  FULCRUM_CHECK(m <= fp8_.max_rows && k <= fp8_.max_k && (out_f32 == nullptr || n <= fp8_.max_n),
                "FP8 dense GEMM [{}, {}] x [{}, {}]^T: beyond its scratch ({} rows, K {}, N {} with fp32 output)", m, k,
                n, k, fp8_.max_rows, fp8_.max_k, fp8_.max_n);
  FULCRUM_CHECK(w.device_codes_ptr != nullptr && w.device_scales_ptr != nullptr,
                "FP8 dense GEMM [{}, {}] x [{}, {}]^T: the weight's pointers are not in device memory", m, k, n, k);
  const int32_t* offsets = row_pairs_ + 2 * m;  // {0, m}
  FULCRUM_CUDA_CHECK(launch_quantize_rows_fp8(x, static_cast<int>(k), offsets, 1, m, fp8_x_, fp8_x_scales_, stream_));
  Fp8GroupedGemmArgs args;
  args.a = fp8_x_;  // [m, k]
  args.a_scales = fp8_x_scales_;  // [k / 128][m]
  args.offsets = offsets;
  args.num_groups = 1;
  args.b = w.device_codes_ptr;  // [n, k]
  args.b_scales = w.device_scales_ptr;  // [k / 128][n / 128]
  args.num_b = 1;
  args.d = out_bf16 != nullptr ? out_bf16 : fp8_out_bf16_;  // [m, n]
  args.n = static_cast<int>(n);
  args.k = static_cast<int>(k);
  const GroupedGemmStatus status =
      run_fp8_grouped_gemm(args, fp8_grouped_gemm_config_for_rows(m), *fp8_limits_, fp8_workspace_, stream_);
  FULCRUM_CHECK(status.ok(), "FP8 dense GEMM [{}, {}] x [{}, {}]^T: {} ({})", m, k, n, k, status.failed,
                cudaGetErrorString(static_cast<cudaError_t>(status.cuda_error)));
  if (out_f32 != nullptr) {
    // bf16 -> fp32 through the MoE combine with one weight-1 term per row: out = 0 + 1 * bf16 value, exact (the
    // engine's consumers of these outputs read fp32).
    FULCRUM_CUDA_CHECK(cuda::moe::launch_combine_f32(fp8_out_bf16_, row_ids_, row_ones_, m, /*top_k=*/1,
                                                     static_cast<int>(n), out_f32, stream_));
  }
}

}  // namespace fulcrum::gpu
