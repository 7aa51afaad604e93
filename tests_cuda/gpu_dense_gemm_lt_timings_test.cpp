// How far the engine's cuBLAS dense GEMMs (gpu::DenseGemm::run: cublasGemmEx with the default algorithm, rows
// above the skinny kernel's) are from the best cuBLASLt algorithm for the same problem: at the Qwen3-30B-A3B
// projections (qkv, o, router, LM head) and the 235B-A22B qkv / o, m = 8 .. 256 rows, bf16 in, fp32 out. For each
// shape: DenseGemm::run, cuBLASLt's first heuristic, and the fastest of its first 32 heuristics (each timed here),
// as microseconds per call (median of 30 calls, each on its own copy of the weight so that the weights stream from
// HBM) and as a fraction of the weight bytes' roofline at the measured copy bandwidth. Measures and prints only.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/dense_gemm.hpp"
#include "gpu/moe/moe_kernels.hpp"

namespace fulcrum::test {
namespace {

constexpr size_t kPoolBytes = size_t{384} << 20;  // weight copies: several times the 50 MB L2
constexpr int kSamples = 30;
constexpr int kMaxAlgos = 32;

struct Alloc {
  explicit Alloc(size_t bytes) { EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(bytes, 16)), cudaSuccess); }
  ~Alloc() { cudaFree(ptr); }
  Alloc(const Alloc&) = delete;
  Alloc& operator=(const Alloc&) = delete;
  void* ptr = nullptr;
};

// Median microseconds of one call of run(copy), over kSamples calls cycling through `copies`.
template <typename Run>
double median_call_us(cudaStream_t stream, int copies, Run run) {
  for (int i = 0; i < 3; ++i) run(i % copies);
  std::vector<cudaEvent_t> ev(2 * kSamples);
  for (auto& e : ev) EXPECT_EQ(cudaEventCreate(&e), cudaSuccess);
  for (int i = 0; i < kSamples; ++i) {
    EXPECT_EQ(cudaEventRecord(ev[2 * i], stream), cudaSuccess);
    run((3 + i) % copies);
    EXPECT_EQ(cudaEventRecord(ev[2 * i + 1], stream), cudaSuccess);
  }
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<double> us(kSamples);
  for (int i = 0; i < kSamples; ++i) {
    float ms = 0;
    EXPECT_EQ(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), cudaSuccess);
    us[i] = 1e3 * ms;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::nth_element(us.begin(), us.begin() + kSamples / 2, us.end());
  return us[kSamples / 2];
}

double copy_bandwidth(cudaStream_t stream) {
  constexpr size_t kBytes = size_t{1} << 30;
  Alloc a(kBytes), b(kBytes);
  const double us = median_call_us(stream, 1, [&](int) {
    EXPECT_EQ(cudaMemcpyAsync(b.ptr, a.ptr, kBytes, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
  });
  return 2.0 * kBytes / (1e-6 * us);
}

TEST(DenseGemmLtTimings, PrintsTimings) {
  if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  constexpr size_t kWorkspace = size_t{32} << 20;
  Alloc workspace(kWorkspace);
  const double bandwidth = copy_bandwidth(stream);
  std::printf("device copy bandwidth %.0f GB/s\n", bandwidth / 1e9);
  std::printf("%-9s %6s %5s %4s %9s %9s %9s %5s %7s %7s\n", "shape", "n", "k", "m", "gemmex us", "lt#0 us", "best us",
              "algo", "gemmex%", "best%");
  struct Shape {
    const char* name;
    int n, k;
  };
  const Shape shapes[] = {{"30b qkv", 5120, 2048}, {"30b o", 2048, 4096},   {"router", 128, 2048},
                          {"lm_head", 151936, 2048}, {"235b qkv", 9216, 4096}, {"235b o", 4096, 8192}};
  {
    gpu::DenseGemm gemm(stream, 0);
    for (const Shape& s : shapes) {
      const size_t w_bytes = sizeof(uint16_t) * static_cast<size_t>(s.n) * s.k;
      const int copies = static_cast<int>(std::max<size_t>(1, kPoolBytes / w_bytes));
      Alloc w(w_bytes * copies), x(sizeof(uint16_t) * 256 * s.k), out(sizeof(float) * 256 * static_cast<size_t>(s.n));
      ASSERT_EQ(cuda::moe::launch_fill_random_bf16(static_cast<uint16_t*>(w.ptr), static_cast<int64_t>(w_bytes / 2) * copies,
                                                   1, 0.05f, stream),
                cudaSuccess);
      ASSERT_EQ(cuda::moe::launch_fill_random_bf16(static_cast<uint16_t*>(x.ptr), int64_t{256} * s.k, 2, 1.0f, stream),
                cudaSuccess);
      const auto w_at = [&](int copy) {
        return static_cast<const uint16_t*>(w.ptr) + static_cast<size_t>(copy) * s.n * s.k;
      };
      for (const int m : {8, 16, 32, 64, 128, 256}) {
        if (s.n > 100000 && m > 64) continue;  // the LM head only sees the sampling rows
        const double gemmex = median_call_us(stream, copies, [&](int c) {
          gemm.run(static_cast<const uint16_t*>(x.ptr), w_at(c), m, s.n, s.k, out.ptr, gpu::GemmOut::kF32);
        });
        // out^T [n, m] (column-major) = W^T x x^T, as DenseGemm's call.
        cublasLtMatmulDesc_t op = nullptr;
        ASSERT_EQ(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
        const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
        cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
        cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.k, s.n, s.k);
        cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.k, m, s.k);
        cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, s.n, m, s.n);
        cublasLtMatmulPreference_t pref = nullptr;
        cublasLtMatmulPreferenceCreate(&pref);
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspace, sizeof(kWorkspace));
        cublasLtMatmulHeuristicResult_t results[kMaxAlgos] = {};
        int found = 0;
        ASSERT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, kMaxAlgos, results, &found),
                  CUBLAS_STATUS_SUCCESS);
        const float alpha = 1.0f, beta = 0.0f;
        double first = 0, best = 1e30;
        int best_idx = -1;
        for (int a = 0; a < found; ++a) {
          bool ok = true;
          const double us = median_call_us(stream, copies, [&](int c) {
            ok = ok && cublasLtMatmul(lt, op, &alpha, w_at(c), la, x.ptr, lb, &beta, out.ptr, lc, out.ptr, lc,
                                      &results[a].algo, workspace.ptr, kWorkspace, stream) == CUBLAS_STATUS_SUCCESS;
          });
          if (!ok) continue;
          if (a == 0) first = us;
          if (us < best) best = us, best_idx = a;
        }
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatmulDescDestroy(op);
        const double roofline_us = 1e6 * static_cast<double>(w_bytes) / bandwidth;
        std::printf("%-9s %6d %5d %4d %9.2f %9.2f %9.2f %2d/%-2d %6.0f%% %6.0f%%\n", s.name, s.n, s.k, m, gemmex, first,
                    best, best_idx, found, 100 * roofline_us / gemmex, 100 * roofline_us / best);
      }
    }
  }
  cublasLtDestroy(lt);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace fulcrum::test
