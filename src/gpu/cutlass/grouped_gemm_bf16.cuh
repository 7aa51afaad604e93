#pragma once
// One CUTLASS 4.2 SM90 bf16 grouped GEMM config and its setup kernel, as a template that each config's .cu
// instantiates once (see grouped_gemm.hpp for the contract). The kernel follows CUTLASS example 57 and the
// project's probe (../shared/examples/kernel-probe/gg_kernels.cu, run on an H200): ptr-array TMA
// warp-specialized mainloop, GroupProblemShape<M, N, K> with the problem shapes in device memory only, A
// row-major [M, K], B stored [N, K] (CUTLASS ColumnMajor K x N), no C operand (ElementC = void, beta 0),
// row-major bf16 D, fp32 accumulation.
//
// kSwapAB (the configs for decode-sized groups): CUTLASS computes D^T = B A^T instead, its M being the weights' N and
// its N the group's rows, so a group of 1-8 rows fills a narrow N tile (16-64) instead of padding a 64-row M tile;
// every operand keeps its memory layout (weights [N, K] are a row-major M x K A, the rows [m, K] a column-major
// K x m B), and D^T column-major [N, m] is the same memory as row-major D [m, N].
#include <type_traits>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/util/packed_stride.hpp"
#include "gpu/cutlass/grouped_gemm_detail.hpp"
#include "gpu/kernels/dependent_launch.cuh"

namespace fulcrum::gpu::grouped_gemm_detail {

template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule, bool SwapAB = false>
struct Bf16GroupedGemm {
  static constexpr bool kSwapAB = SwapAB;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // <M, N, K> per group
  using GroupShape = typename ProblemShape::UnderlyingProblemShape;
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;     // activations [M, K] (swapped: weights [N, K])
  using LayoutB = cutlass::layout::ColumnMajor;  // weights stored [N, K] (swapped: activations [m, K])
  using LayoutC = cutlass::layout::RowMajor;
  using LayoutD = std::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;  // out [m, N]
  static constexpr int kAlignment = 8;           // bf16 elements per 16 bytes (TMA)
  using ElementAccumulator = float;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator, void, LayoutC*,
      kAlignment, ElementD, LayoutD*, kAlignment, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignment, ElementB, LayoutB*,
      kAlignment, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;

  // The per-group arrays CUTLASS reads, carved out of the workspace after CUTLASS's own part.
  struct GroupArrays {
    GroupShape* shapes = nullptr;  // [max_groups]
    const ElementA** a = nullptr;
    const ElementB** b = nullptr;
    ElementD** d = nullptr;
    StrideA* stride_a = nullptr;
    StrideB* stride_b = nullptr;
    StrideD* stride_d = nullptr;
  };

  static size_t group_arrays_bytes(int max_groups) {
    const auto n = static_cast<size_t>(max_groups);
    return align_up(sizeof(GroupShape) * n) + 3 * align_up(sizeof(void*) * n) + align_up(sizeof(StrideA) * n) +
           align_up(sizeof(StrideB) * n) + align_up(sizeof(StrideD) * n);
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
    arrays.stride_a = reinterpret_cast<StrideA*>(take(sizeof(StrideA) * n));
    arrays.stride_b = reinterpret_cast<StrideB*>(take(sizeof(StrideB) * n));
    arrays.stride_d = reinterpret_cast<StrideD*>(take(sizeof(StrideD) * n));
    return arrays;
  }

  static typename Gemm::Arguments arguments(const GroupArrays& arrays, int num_groups,
                                            const cutlass::KernelHardwareInfo& hw) {
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {num_groups, arrays.shapes, nullptr},  // host problem shapes: none
                                  {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b},
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

// What the setup kernel needs of one GEMM (device pointers; see GroupedGemmArgs) and where it writes its arrays.
template <class G>
struct SetupJob {
  const int32_t* offsets = nullptr;
  int num_groups = 0;
  const uint16_t* const* b = nullptr;
  int num_b = 0;
  const uint16_t* a = nullptr;
  uint16_t* d = nullptr;
  int n = 0;
  int k = 0;
  typename G::GroupArrays arrays;
};

// Offsets -> CUTLASS's per-group problem shapes, pointers and strides: block j for job j (one or two GEMMs: the
// MoE pair's both GEMMs in one launch), one thread per group. A programmatic dependent launch
// (dependent_launch.cuh): the offsets come from the kernel before it.
template <class G>
__global__ void grouped_gemm_setup_kernel(SetupJob<G> first, SetupJob<G> second) {
  fulcrum::gpu::wait_then_release();
  using ElementA = typename G::ElementA;
  using ElementB = typename G::ElementB;
  using ElementD = typename G::ElementD;
  const SetupJob<G>& job = blockIdx.x == 0 ? first : second;
  const int n = job.n, k = job.k;
  for (int g = threadIdx.x; g < job.num_groups; g += blockDim.x) {
    const int32_t row_begin = job.offsets[g];
    const int32_t count = job.offsets[g + 1] - row_begin;
    const int m = count > 0 ? count : 0;
    const uint16_t* rows = job.a + static_cast<int64_t>(row_begin) * k;
    const uint16_t* weights = job.b[g % job.num_b];
    const typename G::GroupArrays& arrays = job.arrays;
    arrays.d[g] = reinterpret_cast<ElementD*>(job.d) + static_cast<int64_t>(row_begin) * n;
    if constexpr (G::kSwapAB) {  // D^T [n, m] = W [n, k] x rows^T
      arrays.shapes[g] = cute::make_shape(n, m, k);
      arrays.a[g] = reinterpret_cast<const ElementA*>(weights);
      arrays.b[g] = reinterpret_cast<const ElementB*>(rows);
      arrays.stride_a[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {n, k, 1});
      arrays.stride_b[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {m, k, 1});
      arrays.stride_d[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {n, m, 1});
    } else {
      arrays.shapes[g] = cute::make_shape(m, n, k);
      arrays.a[g] = reinterpret_cast<const ElementA*>(rows);
      arrays.b[g] = reinterpret_cast<const ElementB*>(weights);
      arrays.stride_a[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, k, 1});
      arrays.stride_b[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1});
      arrays.stride_d[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, n, 1});
    }
  }
}

template <class G>
GroupedGemmStatus prepare_config(int device, int sm_count, int max_groups, ConfigFacts* facts) {
  const int smem_bytes = G::GemmKernel::SharedStorageSize;
  if (smem_bytes >= (48 << 10)) {
    const cudaError_t status = cudaFuncSetAttribute(cutlass::device_kernel<typename G::GemmKernel>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (status != cudaSuccess) return {"cudaFuncSetAttribute (grouped GEMM shared memory)", static_cast<int>(status)};
  }
  facts->max_active_clusters = cutlass::KernelHardwareInfo::query_device_max_active_clusters<typename G::GemmKernel>();
  (void)cudaGetLastError();  // a failed occupancy query only leaves the grid to the SM count
  const cutlass::KernelHardwareInfo hw{device, sm_count, facts->max_active_clusters};
  const typename G::Gemm::Arguments args = G::arguments(typename G::GroupArrays{}, max_groups, hw);
  if (G::Gemm::can_implement(args) != cutlass::Status::kSuccess) return {"CUTLASS can_implement (grouped GEMM)", 0};
  facts->cutlass_workspace_bytes = G::Gemm::get_workspace_size(args);
  facts->group_arrays_bytes = G::group_arrays_bytes(max_groups);
  return {};
}

template <class G>
typename G::GroupArrays arrays_of_region(const GroupedGemmLimits& limits, void* workspace, int region) {
  return G::carve(static_cast<char*>(workspace) + limits.cutlass_workspace_bytes + region * limits.group_arrays_bytes,
                  limits.max_groups);
}

template <class G>
GroupedGemmStatus run_config(const GroupedGemmStage& stage, int config_idx, const GroupedGemmLimits& limits,
                             void* workspace, CUstream_st* stream) {
  if (stage.setup_count > 0) {
    SetupJob<G> jobs[kGroupedGemmRegions];
    for (int j = 0; j < stage.setup_count; ++j) {
      const GroupedGemmArgs& args = *stage.setup[j];
      jobs[j] = {args.offsets, args.num_groups, args.b,    args.num_b,
                 args.a,       args.d,          args.n,    args.k,
                 arrays_of_region<G>(limits, workspace, j)};
    }
    const cudaError_t status = fulcrum::gpu::launch_dependent(grouped_gemm_setup_kernel<G>, dim3(stage.setup_count),
                                                              dim3(256), 0, stream, jobs[0], jobs[1]);
    if (status != cudaSuccess) return {"grouped GEMM setup kernel launch", static_cast<int>(status)};
  }
  if (stage.launch_region < 0) return {};
  const cutlass::KernelHardwareInfo hw{limits.device, limits.sm_count, limits.max_active_clusters[config_idx]};
  // Params hold only the arrays' addresses, the group count and the device facts (host work, no launch).
  typename G::GemmKernel::Params params = G::GemmKernel::to_underlying_arguments(
      G::arguments(arrays_of_region<G>(limits, workspace, stage.launch_region), stage.launch_groups, hw), workspace);
  if (G::Gemm::run(params, stream) != cutlass::Status::kSuccess) {
    return {"CUTLASS grouped GEMM launch", static_cast<int>(cudaErrorLaunchFailure)};
  }
  return {};
}

}  // namespace fulcrum::gpu::grouped_gemm_detail
