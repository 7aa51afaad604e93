#pragma once
// One dense weight held in FP8 on the device, as the engine's FP8 GEMMs take it (DenseGemm::run_fp8):
//   codes  e4m3 [n, k] row-major (the checkpoint's [out, in] layout)
//   scales fp32 [k / 128][n / 128]: W[j][c] = e4m3(codes[j][c]) * scales[(c / 128) * (n / 128) + j / 128]
//          (the checkpoint's weight_scale_inv [n / 128][k / 128] transposed: the MN-major layout that both
//          launch_skinny_gemm_fp8 and run_fp8_grouped_gemm read)
// The grouped GEMM reads its weight pointers from device memory, so the same two pointers also lie in device
// memory (DeviceWeights writes them once at construction): device_codes_ptr[0] == codes,
// device_scales_ptr[0] == scales. No CUDA header.
#include <cstdint>

namespace fulcrum::gpu {

struct Fp8Weight {
  const uint8_t* codes = nullptr;  // null: this projection is bf16
  const float* scales = nullptr;
  const uint8_t* const* device_codes_ptr = nullptr;
  const float* const* device_scales_ptr = nullptr;
  bool present() const { return codes != nullptr; }
};

}  // namespace fulcrum::gpu
