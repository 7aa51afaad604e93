// How far cuBLAS's default choice for the engine's dense projections is from the best cuBLASLt algorithm, at the
// decode row counts that run through cuBLAS (m > 8, and 4..8 for QKV / LM head). A measurement, no assertion on
// time: for each model shape and m it prints cublasGemmEx (what DenseGemm runs), cuBLASLt's first heuristic, the
// fastest of its first 32 heuristic algorithms, and the skinny kernel (one launch per 8 rows), each as a median
// over rotating weight copies (so W comes from HBM, as in a step), with the fraction of the HBM roofline.
#include <algorithm>
#include <cstdio>
#include <vector>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.hpp"
#include "gpu/dense_gemm.hpp"
#include "gpu/kernels/skinny_gemm.hpp"
#include "skinny_test_util.hpp"

namespace fulcrum::test {
namespace {

using backend::DeviceBuffer;
using namespace skinny_test;

struct LtProblem {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  ~LtProblem() {
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
    for (cublasLtMatrixLayout_t l : {a, b, c}) {
      if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
    }
  }
};

TEST(DenseGemmLtTimings, PrintsTimings) {
  if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  constexpr double kHbmBytesPerSecond = 4.2e12;
  constexpr size_t kPoolBytes = size_t{256} << 20;
  constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  DeviceBuffer workspace(kWorkspaceBytes);
  {
    gpu::DenseGemm cublas(stream, 0);
    cublas.set_skinny(false);
    struct Shape {
      int n, k;
      const char* name;
    };
    const Shape shapes[] = {{5120, 2048, "qkv"}, {2048, 4096, "o_proj"}, {128, 2048, "router"}, {151936, 2048, "lm_head"}};
    std::printf("%-8s %4s %10s %10s %10s %4s %10s %8s %8s %8s %8s\n", "shape", "m", "gemmex us", "lt#0 us", "lt best us",
                "idx", "skinny us", "gemmex %", "lt#0 %", "best %", "skinny %");
    for (const Shape& shape : shapes) {
      const int n = shape.n, k = shape.k;
      const size_t w_bytes = sizeof(uint16_t) * static_cast<size_t>(n) * k;
      const int copies = static_cast<int>(std::max<size_t>(1, (kPoolBytes + w_bytes - 1) / w_bytes));
      DeviceBuffer w_pool(w_bytes * copies);
      ASSERT_EQ(cudaMemset(w_pool.as<uint16_t>(), 0x3c, w_bytes * copies), cudaSuccess);
      constexpr int kMaxM = 256;
      DeviceBuffer x_dev = upload(random_bf16(static_cast<size_t>(kMaxM) * k, 7));
      DeviceBuffer out_dev(sizeof(float) * kMaxM * static_cast<size_t>(n));
      const auto w_copy = [&](int copy) { return w_pool.as<uint16_t>() + static_cast<size_t>(copy) * n * k; };
      const double roofline_us = 1e6 * static_cast<double>(w_bytes) / kHbmBytesPerSecond;
      for (const int m : {4, 8, 12, 16, 24, 32, 64, 128, 256}) {
        const double gemmex = median_us(stream, copies, [&](int copy) {
          cublas.run(x_dev.as<uint16_t>(), w_copy(copy), m, n, k, out_dev.as<float>(), gpu::GemmOut::kF32);
        });
        LtProblem p;
        ASSERT_EQ(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
        const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
        ASSERT_EQ(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, k, n, k), CUBLAS_STATUS_SUCCESS);
        ASSERT_EQ(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k), CUBLAS_STATUS_SUCCESS);
        ASSERT_EQ(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, n, m, n), CUBLAS_STATUS_SUCCESS);
        cublasLtMatmulPreference_t pref = nullptr;
        ASSERT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspaceBytes,
                                             sizeof(kWorkspaceBytes));
        std::vector<cublasLtMatmulHeuristicResult_t> results(32);
        int found = 0;
        cublasLtMatmulAlgoGetHeuristic(lt, p.op, p.a, p.b, p.c, p.c, pref, static_cast<int>(results.size()),
                                       results.data(), &found);
        cublasLtMatmulPreferenceDestroy(pref);
        const float alpha = 1.0f, beta = 0.0f;
        double first = -1, best = 1e30;
        int best_idx = -1;
        for (int i = 0; i < found; ++i) {
          if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
          bool ok = true;
          const double us = median_us(stream, copies, [&](int copy) {
            const cublasStatus_t s =
                cublasLtMatmul(lt, p.op, &alpha, w_copy(copy), p.a, x_dev.as<uint16_t>(), p.b, &beta,
                               out_dev.as<float>(), p.c, out_dev.as<float>(), p.c, &results[i].algo,
                               workspace.as<uint8_t>(), kWorkspaceBytes, stream);
            ok = ok && s == CUBLAS_STATUS_SUCCESS;
          });
          if (!ok) continue;
          if (first < 0) first = us;
          if (us < best) {
            best = us;
            best_idx = i;
          }
        }
        double skinny = -1;
        if (m <= 32) {
          skinny = median_us(stream, copies, [&](int copy) {
            for (int r = 0; r < m; r += gpu::kSkinnyGemmMaxRows) {
              const int rows = std::min(gpu::kSkinnyGemmMaxRows, m - r);
              EXPECT_EQ(gpu::launch_skinny_gemm(x_dev.as<uint16_t>() + static_cast<size_t>(r) * k, w_copy(copy), rows,
                                                n, k, out_dev.as<float>() + static_cast<size_t>(r) * n, nullptr, stream),
                        cudaSuccess);
            }
          });
        }
        const auto pct = [&](double us) { return us > 0 ? 100 * roofline_us / us : 0.0; };
        std::printf("%-8s %4d %10.2f %10.2f %10.2f %4d %10.2f %7.0f%% %7.0f%% %7.0f%% %7.0f%%\n", shape.name, m, gemmex,
                    first, best, best_idx, skinny, pct(gemmex), pct(first), pct(best), pct(skinny));
      }
    }
  }
  cublasLtDestroy(lt);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace fulcrum::test
