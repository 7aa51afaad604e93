#pragma once
// One CUTLASS 4.2 SM90 FP8 blockwise-scaled grouped GEMM config and its setup kernel, as a template that each
// config's .cu instantiates once (contract: grouped_gemm_fp8.hpp). Follows CUTLASS example 68 and the project's
// probe (../shared/examples/kernel-probe/gg_kernels.cu, variants fp8_*, run on an H200): ptr-array TMA
// warp-specialized FP8 blockwise mainloop, Sm90BlockwiseScaleConfig<1, 128, 128> (one scale per row and
// 128-wide k block of A, one per 128x128 block of B, both MN-major), GroupProblemShape<M, N, K> in device
// memory only, A e4m3 row-major [M, K], B e4m3 stored [N, K] (CUTLASS ColumnMajor K x N), no C operand,
// row-major bf16 D, fp32 accumulation promoted once per 128-wide k block.
//
// Scale layouts, checked against cutlass/detail/blockwise_scale_layout.hpp (Sm1xxBlockwiseScaleConfig, MN
// major): tile_atom_to_shape_SFA((M, N, K, 1)) has shape ((1, M), (128, K/128), 1) and stride ((0, 1), (0, M), .),
// so sa(m, k) sits at m + (k / 128) * M: [K/128][M] per group, M contiguous; tile_atom_to_shape_SFB has shape
// ((128, N/128), (128, K/128), 1) and stride ((0, 1), (0, N/128), .): sb(n, k) at n / 128 + (k / 128) * (N/128).
// In grouped mode the mainloop (sm90_mma_array_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp,
// tensors_perform_update -> load_init) rebuilds both layouts from the group's problem shape and reads only
// ptr_SFA[g] / ptr_SFB[g]; the layout arrays are still filled (as the probe and example 68 do) so a CUTLASS
// that reads them gets the same layouts.
//
// kSwapAB (decode-sized groups, as grouped_gemm_bf16.cuh): CUTLASS computes D^T = B A^T, its M the weights' N and
// its N the group's rows, so 1-16 rows fill a narrow N tile instead of padding a 64-row M tile. No memory layout
// changes: the weights [N, K] are a row-major A, the rows [m, K] a column-major B, D^T column-major [N, m] is
// row-major D [m, N]; Sm90BlockwiseScaleConfig<128, 1, 128> (MN-major) puts sa'(n, k) at n / 128 + (k / 128) *
// (N/128) (the weight scales as they lie) and sb'(r, k) at r + (k / 128) * m (the group's activation scales).
#include <type_traits>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/util/packed_stride.hpp"
#include "gpu/cutlass/grouped_gemm_fp8_detail.hpp"

namespace fulcrum::gpu::grouped_gemm_detail {

template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule, bool SwapAB = false>
struct Fp8GroupedGemm {
  static constexpr bool kSwapAB = SwapAB;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // <M, N, K> per group
  using GroupShape = typename ProblemShape::UnderlyingProblemShape;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using ElementScale = float;
  using LayoutA = cutlass::layout::RowMajor;     // activations [M, K] (swapped: weights [N, K])
  using LayoutB = cutlass::layout::ColumnMajor;  // weights stored [N, K] (swapped: activations [m, K])
  using LayoutC = cutlass::layout::RowMajor;
  using LayoutD = std::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;  // out [m, N]
  static constexpr int kAlignmentAB = 16;        // e4m3 elements per 16 bytes (TMA)
  static constexpr int kAlignmentD = 8;          // bf16 elements per 16 bytes
  using ElementAccumulator = float;
  static constexpr int kScaleM = kSwapAB ? kFp8BlockSize : 1;  // CUTLASS's M: the rows, or swapped the weights'
  static constexpr int kScaleN = kSwapAB ? 1 : kFp8BlockSize;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<kScaleM, kScaleN, kFp8BlockSize>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator, void, LayoutC*,
      kAlignmentD, ElementD, LayoutD*, kAlignmentD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignmentAB,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignmentAB, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;

  static_assert(CollectiveMainloop::ScaleGranularityM == kScaleM && CollectiveMainloop::ScaleGranularityN == kScaleN &&
                    CollectiveMainloop::ScaleGranularityK == kFp8BlockSize,
                "1x128 activation scales, 128x128 weight scales");
  static_assert(CollectiveMainloop::MMajorSFA && CollectiveMainloop::NMajorSFB, "MN-major scale layouts");

  // The per-group arrays CUTLASS reads, carved out of the workspace after CUTLASS's own part.
  struct GroupArrays {
    GroupShape* shapes = nullptr;  // [max_groups]
    const ElementA** a = nullptr;
    const ElementB** b = nullptr;
    ElementD** d = nullptr;
    const ElementScale** sfa = nullptr;
    const ElementScale** sfb = nullptr;
    StrideA* stride_a = nullptr;
    StrideB* stride_b = nullptr;
    StrideD* stride_d = nullptr;
    LayoutSFA* layout_sfa = nullptr;
    LayoutSFB* layout_sfb = nullptr;
  };

  static size_t group_arrays_bytes(int max_groups) {
    const auto n = static_cast<size_t>(max_groups);
    return align_up(sizeof(GroupShape) * n) + 5 * align_up(sizeof(void*) * n) + align_up(sizeof(StrideA) * n) +
           align_up(sizeof(StrideB) * n) + align_up(sizeof(StrideD) * n) + align_up(sizeof(LayoutSFA) * n) +
           align_up(sizeof(LayoutSFB) * n);
  }

  static GroupArrays carve(void* base, int max_groups) {
    const auto n = static_cast<size_t>(max_groups);
    char* p = static_cast<char*>(base);
    GroupArrays arrays;
    const auto take = [&](size_t bytes) {
      char* here = p;
      p += align_up(bytes);
      return here;
    };
    arrays.shapes = reinterpret_cast<GroupShape*>(take(sizeof(GroupShape) * n));
    arrays.a = reinterpret_cast<const ElementA**>(take(sizeof(void*) * n));
    arrays.b = reinterpret_cast<const ElementB**>(take(sizeof(void*) * n));
    arrays.d = reinterpret_cast<ElementD**>(take(sizeof(void*) * n));
    arrays.sfa = reinterpret_cast<const ElementScale**>(take(sizeof(void*) * n));
    arrays.sfb = reinterpret_cast<const ElementScale**>(take(sizeof(void*) * n));
    arrays.stride_a = reinterpret_cast<StrideA*>(take(sizeof(StrideA) * n));
    arrays.stride_b = reinterpret_cast<StrideB*>(take(sizeof(StrideB) * n));
    arrays.stride_d = reinterpret_cast<StrideD*>(take(sizeof(StrideD) * n));
    arrays.layout_sfa = reinterpret_cast<LayoutSFA*>(take(sizeof(LayoutSFA) * n));
    arrays.layout_sfb = reinterpret_cast<LayoutSFB*>(take(sizeof(LayoutSFB) * n));
    return arrays;
  }

  static typename Gemm::Arguments arguments(const GroupArrays& arrays, int num_groups,
                                            const cutlass::KernelHardwareInfo& hw) {
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {num_groups, arrays.shapes, nullptr},  // host problem shapes: none
                                  {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b, arrays.sfa, arrays.layout_sfa,
                                   arrays.sfb, arrays.layout_sfb},
                                  {{}, nullptr, nullptr, arrays.d, arrays.stride_d},
                                  hw};
    auto& fusion = args.epilogue.thread;  // D = 1 * acc (no C)
    fusion.alpha = 1.0f;
    fusion.beta = 0.0f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
    fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
    fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
    return args;
  }
};

// Offsets -> CUTLASS's per-group problem shapes, operand and scale pointers, strides and scale layouts. One
// thread per group. Group g: first row f = offsets[g], m rows; its activation scales start at a_scales + f * Kb.
template <class G>
__global__ void fp8_grouped_gemm_setup_kernel(const int32_t* offsets, int num_groups, const uint8_t* const* b,
                                              const float* const* b_scales, int num_b, const uint8_t* a,
                                              const float* a_scales, uint16_t* d, int n, int k,
                                              typename G::GroupArrays arrays) {
  using ElementA = typename G::ElementA;
  using ElementB = typename G::ElementB;
  using ElementD = typename G::ElementD;
  const int k_blocks = k / kFp8BlockSize;
  for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < num_groups; g += gridDim.x * blockDim.x) {
    const int32_t first = offsets[g];
    const int32_t count = offsets[g + 1] - first;
    const int m = count > 0 ? count : 0;
    const int w = g % num_b;
    const ElementA* rows = reinterpret_cast<const ElementA*>(a) + static_cast<int64_t>(first) * k;
    const float* row_scales = a_scales + static_cast<int64_t>(first) * k_blocks;  // [Kb][m] of this group
    arrays.d[g] = reinterpret_cast<ElementD*>(d) + static_cast<int64_t>(first) * n;
    if constexpr (G::kSwapAB) {  // D^T [n, m] = W [n, k] x rows^T
      arrays.shapes[g] = cute::make_shape(n, m, k);
      arrays.a[g] = reinterpret_cast<const ElementA*>(b[w]);
      arrays.b[g] = reinterpret_cast<const ElementB*>(rows);
      arrays.sfa[g] = b_scales[w];  // [Kb][N / 128]
      arrays.sfb[g] = row_scales;
      arrays.stride_a[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {n, k, 1});
      arrays.stride_b[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {m, k, 1});
      arrays.stride_d[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {n, m, 1});
    } else {
      arrays.shapes[g] = cute::make_shape(m, n, k);
      arrays.a[g] = rows;
      arrays.b[g] = reinterpret_cast<const ElementB*>(b[w]);
      arrays.sfa[g] = row_scales;
      arrays.sfb[g] = b_scales[w];  // [Kb][N / 128]
      arrays.stride_a[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, k, 1});
      arrays.stride_b[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1});
      arrays.stride_d[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, n, 1});
    }
    const auto shape = G::kSwapAB ? cute::make_shape(n, m, k, 1) : cute::make_shape(m, n, k, 1);
    arrays.layout_sfa[g] = G::ScaleConfig::tile_atom_to_shape_SFA(shape);
    arrays.layout_sfb[g] = G::ScaleConfig::tile_atom_to_shape_SFB(shape);
  }
}

template <class G>
GroupedGemmStatus prepare_fp8_config(int device, int sm_count, int max_groups, ConfigFacts* facts) {
  const int smem_bytes = G::GemmKernel::SharedStorageSize;
  if (smem_bytes >= (48 << 10)) {
    const cudaError_t status = cudaFuncSetAttribute(cutlass::device_kernel<typename G::GemmKernel>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (status != cudaSuccess) {
      return {"cudaFuncSetAttribute (FP8 grouped GEMM shared memory)", static_cast<int>(status)};
    }
  }
  facts->max_active_clusters = cutlass::KernelHardwareInfo::query_device_max_active_clusters<typename G::GemmKernel>();
  (void)cudaGetLastError();  // a failed occupancy query only leaves the grid to the SM count
  const cutlass::KernelHardwareInfo hw{device, sm_count, facts->max_active_clusters};
  const typename G::Gemm::Arguments args = G::arguments(typename G::GroupArrays{}, max_groups, hw);
  if (G::Gemm::can_implement(args) != cutlass::Status::kSuccess) {
    return {"CUTLASS can_implement (FP8 grouped GEMM)", 0};
  }
  facts->cutlass_workspace_bytes = G::Gemm::get_workspace_size(args);
  facts->group_arrays_bytes = G::group_arrays_bytes(max_groups);
  return {};
}

template <class G>
GroupedGemmStatus run_fp8_config(const Fp8GroupedGemmArgs& args, int config_idx, const Fp8GroupedGemmLimits& limits,
                                 void* workspace, CUstream_st* stream) {
  const typename G::GroupArrays arrays =
      G::carve(static_cast<char*>(workspace) + limits.cutlass_workspace_bytes, limits.max_groups);
  fp8_grouped_gemm_setup_kernel<G><<<1, 256, 0, stream>>>(args.offsets, args.num_groups, args.b, args.b_scales,
                                                          args.num_b, args.a, args.a_scales, args.d, args.n, args.k,
                                                          arrays);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return {"FP8 grouped GEMM setup kernel launch", static_cast<int>(status)};
  const cutlass::KernelHardwareInfo hw{limits.device, limits.sm_count, limits.max_active_clusters[config_idx]};
  // Params hold only the arrays' addresses, the group count and the device facts (host work, no launch).
  typename G::GemmKernel::Params params =
      G::GemmKernel::to_underlying_arguments(G::arguments(arrays, args.num_groups, hw), workspace);
  if (G::Gemm::run(params, stream) != cutlass::Status::kSuccess) {
    return {"CUTLASS FP8 grouped GEMM launch", static_cast<int>(cudaErrorLaunchFailure)};
  }
  return {};
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
