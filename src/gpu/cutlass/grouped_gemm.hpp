#pragma once
// bf16 grouped GEMM for the MoE expert stage (CUTLASS 4.2, SM90 ptr-array TMA warp-specialized kernels,
// grouped_gemm_bf16*.cu), capture-safe: the group sizes are read from DEVICE memory, so one call can sit in
// a CUDA graph and be replayed with other routing.
//
// Group g (0 <= g < num_groups) is rows [offsets[g], offsets[g + 1]) of the row-major activations a [rows, K];
// it is multiplied by its weights b[g % num_b] [N, K] (row-major, i.e. D = A B^T, "TN") into the same rows of
// d [rows, N]: d[r][n] = bf16(sum_k a[r][k] * b_g[n][k]), fp32 accumulation, round to nearest even. Groups
// with 0 rows are fine. offsets are absolute row indices (the permutation's slot offsets; a sub-range of
// slots is offsets + first_slot), non-decreasing. CPU reference: the loop above (tests_cuda/gpu_grouped_gemm_test.cpp).
//
// Call sequence: prepare_grouped_gemm once per device and group capacity (host only: kernel attributes,
// SM count, workspace size; never inside a capture), allocate limits.workspace_bytes of device memory, then
// run_grouped_gemm as often as wanted, captured or not. A run is a setup kernel (offsets -> CUTLASS's
// problem shapes, pointer and stride arrays, written into the workspace) followed by the GEMM with the host
// problem-shape pointer null (device-side problem sizes, as CUTLASS example 57 allows). The workspace holds
// per-SM TMA descriptors and those arrays: calls that share one must be ordered (one stream). The MoE expert pair
// (gate_up, SwiGLU, down) can instead write both GEMMs' arrays in one setup launch (setup_grouped_gemm_pair, into
// the workspace's two array regions) and then launch each GEMM alone (launch_grouped_gemm): one kernel less between
// the GEMMs (decode steps 0.5-0.9% faster at batch 8-16 and 0.2-0.5% at 64 on an H100, docs/benchmarks.md, session
// 42). The GEMMs
// are ordinary launches: CUTLASS's sm90 ptr-array kernels issue no griddepcontrol.wait (a wrapper that waited
// first and launched them as programmatic dependents measured no faster, nor did gathering the decode rows inside
// the setup launch; both removed).
//
// Placement invariance (NOTES): a row's output depends only on its own A row, its group's B and the config:
// no split-K / stream-K (CUTLASS's grouped scheduler gives each output tile its whole k-loop, k-tiles in
// order), rows beyond a group's end are zero-filled by TMA and never mixed into other rows. So a row's bits do
// not depend on how many rows its group holds or where the group sits. The config changes the bits; choose
// it by a quantity that does not depend on placement: grouped_gemm_config_for_rows(T * top_k), never per group.
//
// Shape rule (16-byte TMA strides and addresses): K % 8 == 0 and N % 8 == 0, a, d and every b pointer
// 16-byte aligned. grouped_gemm_shape_problem says why a shape fails; callers fall back to another GEMM.
#include <cstddef>
#include <cstdint>

struct CUstream_st;

namespace fulcrum::gpu {

// Tile configs measured on an H200 (Qwen3-30B-A3B and 235B-A22B expert shapes, 128 groups): pingpong 64x128x64 is
// best at 256-1024 tokens (2K-8K rows; ../shared/docs/gpu-engine.md); pingpong 128x128x64 (cluster 1x2: a 128x128
// tile per consumer warp group, one group's epilogue under the other's main loop) at 4096-16384 tokens (32K-128K
// rows), where it took 0.96 of cooperative 256x128x64's time on average over both shapes and both sizes, the down
// GEMM (K = 768 / 1536) gaining most (bench/results/moe_bf16_config_sweep_d5a0221_h200.txt). Cooperative
// 256x128x64 (cluster 1x2), the large-step config before it, stays for side-by-side measurement
// (FULCRUM_BF16_GEMM_CONFIGS, moe_layer.cpp); cooperative 128x256x64 (cluster 2x1) and 256x128x128 were slower.
// The kSwap* configs (grouped_gemm_bf16.cuh kSwapAB) put the weights' N on the tile's M side (128 rows over both
// consumer warp groups) and a group's rows on a 16- or 32-wide N tile, for decode steps, where a group holds 1-16
// rows, instead of padding a 64-row M tile. Measured in the whole 48-layer decode step of the 30B-A3B shape
// (bench/results/swap_ab_sweep_29b7709_h200.json, docs/benchmarks.md): 128x16x128 took 0.955 / 0.965 / 0.976 /
// 0.988 of pingpong 64x128x64's step time at batch 10 / 16 / 64 / 128 (80-1024 rows), 128x32x128 0.989 at batch 256
// (2048 rows, where 128x16x128 was 1.09x slower); pingpong 64x16x128, 64x32x128 and 128x16x128 and cooperative
// 256x16x64 and 128x64x128 were no faster (swap_ab_sweep_e751e7b_h200.json, the 29b7709 and 7015526 files) and
// were removed.
enum class GroupedGemmConfig : int {
  kPingpong64x128x64 = 0,
  kCooperative256x128x64 = 1,
  kPingpong128x128x64 = 2,
  kSwapCooperative128x16x128 = 3,
  kSwapCooperative128x32x128 = 4,
};
constexpr int kNumGroupedGemmConfigs = 5;
// Total rows (T * top_k) from which the large tile is used: between the measured 8K (pingpong 64x128x64 215 us
// vs cooperative 299 us) and 32K rows (378 us vs 323 us); pingpong 128x128x64 was not timed at 8K-16K rows.
constexpr int64_t kGroupedGemmLargeTileMinRows = 16384;
// Up to these total rows the swapped configs are used (batch 128 / 256 decode at top-8).
constexpr int64_t kGroupedGemmSwap16MaxRows = 1024;
constexpr int64_t kGroupedGemmSwap32MaxRows = 2048;

inline GroupedGemmConfig grouped_gemm_config_for_rows(int64_t total_rows) {
  if (total_rows <= kGroupedGemmSwap16MaxRows) return GroupedGemmConfig::kSwapCooperative128x16x128;
  if (total_rows <= kGroupedGemmSwap32MaxRows) return GroupedGemmConfig::kSwapCooperative128x32x128;
  return total_rows >= kGroupedGemmLargeTileMinRows ? GroupedGemmConfig::kPingpong128x128x64
                                                    : GroupedGemmConfig::kPingpong64x128x64;
}

// Null when D [rows, N] = A [rows, K] B^T can run here, else the reason.
inline const char* grouped_gemm_shape_problem(int n, int k) {
  if (n <= 0 || k <= 0) return "N and K must be positive";
  if (k % 8 != 0) return "K must be a multiple of 8 (16-byte TMA row strides of A and B)";
  if (n % 8 != 0) return "N must be a multiple of 8 (16-byte TMA row stride of D)";
  return nullptr;
}
inline bool grouped_gemm_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// What a call returns: failed is null on success, else names the step; cuda_error is the cudaError_t value
// (0 when the failure was not a CUDA error).
struct GroupedGemmStatus {
  const char* failed = nullptr;
  int cuda_error = 0;
  bool ok() const { return failed == nullptr; }
};

// Device facts and workspace layout from prepare_grouped_gemm.
struct GroupedGemmLimits {
  int device = -1;
  int sm_count = 0;
  int max_active_clusters[kNumGroupedGemmConfigs] = {};
  int max_groups = 0;                 // groups a run may have
  size_t cutlass_workspace_bytes = 0; // CUTLASS's part, at the start of the workspace (max over configs)
  size_t group_arrays_bytes = 0;      // one region of per-group arrays (max over configs)
  size_t workspace_bytes = 0;         // everything: CUTLASS's part, then kGroupedGemmRegions array regions
};

// Regions of per-group arrays in a workspace: one per GEMM that one setup launch prepares.
constexpr int kGroupedGemmRegions = 2;

// Sets the kernels' shared-memory attributes on `device`, reads its SM count and cluster occupancy, checks
// that the kernels can run and sizes the workspace for up to max_groups groups. Host only.
GroupedGemmStatus prepare_grouped_gemm(int device, int max_groups, GroupedGemmLimits* limits);

// One grouped GEMM; all pointers are device pointers.
struct GroupedGemmArgs {
  const uint16_t* a = nullptr;          // [rows, K] bf16 row-major
  const int32_t* offsets = nullptr;     // [num_groups + 1] absolute first rows; group g = [offsets[g], offsets[g + 1])
  int num_groups = 0;                   // <= limits.max_groups; 0: nothing runs
  const uint16_t* const* b = nullptr;   // [num_b] pointers to bf16 [N, K] row-major weights; group g uses b[g % num_b]
  int num_b = 0;
  uint16_t* d = nullptr;                // [rows, N] bf16 row-major; rows outside every group are not written
  int n = 0;
  int k = 0;
};

// Enqueues the setup kernel and the GEMM on `stream`; no allocation, no host synchronization, no host
// read of the offsets (capture-safe). `workspace` holds limits.workspace_bytes.
GroupedGemmStatus run_grouped_gemm(const GroupedGemmArgs& args, GroupedGemmConfig config,
                                   const GroupedGemmLimits& limits, void* workspace, CUstream_st* stream);

// Two GEMMs of one config in two steps: one setup launch writes both GEMMs' group arrays (first's into region 0,
// second's into region 1), then launch_grouped_gemm(args, region) runs each GEMM on them, with any kernels of the
// caller's between (the second GEMM's A may be written after the setup: the setup reads only its address). Same
// checks and capture safety as run_grouped_gemm; the arrays stay valid until the workspace's next setup.
GroupedGemmStatus setup_grouped_gemm_pair(const GroupedGemmArgs& first, const GroupedGemmArgs& second,
                                          GroupedGemmConfig config, const GroupedGemmLimits& limits, void* workspace,
                                          CUstream_st* stream);
GroupedGemmStatus launch_grouped_gemm(const GroupedGemmArgs& args, int region, GroupedGemmConfig config,
                                      const GroupedGemmLimits& limits, void* workspace, CUstream_st* stream);

}  // namespace fulcrum::gpu
