#pragma once
// How the skinny GEMMs (skinny_gemm.cu, expert_skinny_gemm.cu) split their work and size their grids, host side:
// the constants their kernels share (skinny_gemm_core.cuh), the K split, the persistent grids, the bulk-copy
// stages, and the measurement switches (each read once from the environment). Definitions: skinny_plan.cpp.
#include <cstdint>

namespace fulcrum::gpu::skinny {

constexpr int kRowsPerWarp = 4;      // R for 2..8 x rows, and the row group the K split is chosen for
constexpr int kWideRowsPerWarp = 8;  // R for 1 x row
constexpr int kWarpsPerBlock = 4;  // small blocks: at 160 registers (M = 8) 12 warps fit per SM, not 8
constexpr int kThreads = kWarpsPerBlock * 32;
constexpr int kMaxKSplit = kWarpsPerBlock;
constexpr int kMaxRows = 8;
constexpr int64_t kTargetWarps = 4096;  // ~2 waves of 132 SMs x 12..16 resident warps
// kTargetWarps, or FULCRUM_SKINNY_TARGET_WARPS (for measurement: it changes K splits, so results within the
// stated tolerance, placement invariance kept); read once.
int64_t skinny_target_warps();
constexpr int kMinSliceChunks = 64;     // 2 chunks per lane: one full loop trip
constexpr int kChunksPerTrip = 2;

// K slices per row group (1, 2 or 4): more while the grid has fewer than skinny_target_warps() warps and each
// slice keeps at least kMinSliceChunks chunks, so small-N shapes still fill the GPU.
inline int choose_k_split(int64_t row_groups, int64_t chunks) {
  int k_split = 1;
  const int64_t target = skinny_target_warps();
  while (k_split < kMaxKSplit && row_groups * k_split < target && chunks / (2 * k_split) >= kMinSliceChunks) {
    k_split *= 2;
  }
  return k_split;
}

// Blocks per SM of the persistent grids for chunks of m x rows (each block loops over its share of the tiles,
// so a block's setup and launch are paid once, not per tile; the numerics do not depend on it): 4 up to 2 rows,
// 6 from 3 rows (measured side by side at batch 1 / 2 / 4: bench/results/skinny_grid_h200.json).
// FULCRUM_SKINNY_BLOCKS_PER_SM overrides it for measurement (0: one block per tile); read once.
int skinny_blocks_per_sm(int m);
// The grid of `tiles` tiles on the current device: min(tiles, SMs x skinny_blocks_per_sm(m)), or tiles. With
// FULCRUM_SKINNY_EVEN_GRID=1 (read once) a grid below `tiles` is cut to ceil(tiles / q) blocks, q = the tiles a
// block then takes at most, so every block takes q or q - 1 (768 tiles on 528 blocks: 384 blocks of 2, not 240
// of 2 and 288 of 1, which leaves SMs with 4 to 8 tiles depending on where the 2s land).
int64_t skinny_grid_blocks(int64_t tiles, int m);
// The current device's SM count (queried once per device).
int device_sms();

// ---- W by bulk copies into shared memory (bulk_copy.cuh), for the bf16 kernels ----
// A block takes its tiles through `stages` (1 or kBulkStages) buffers of one tile each.
constexpr int kBulkStages = 2;
constexpr int64_t kBulkMaxTileBytes = 96 * 1024;  // two stages within the 227 KB of shared memory a block may use
constexpr int kBulkMaxBlocksPerSm = 8;
// Whether bulk copies apply to tiles of tile_bytes: at most kBulkMaxTileBytes, and unless `forced`, the switches
// (FULCRUM_SKINNY_BULK=0: never; FULCRUM_SKINNY_BULK_MAX_TILE=bytes lowers the bound; read once).
bool bulk_tile_allowed(int64_t tile_bytes, bool forced = false);
// The stages and grid of `kernel` (128 threads, stages x tile_bytes of dynamic shared memory) for `tiles` tiles: one
// stage when the grid then holds every tile (each block asks for its one tile before its wait), else the count that
// keeps more bytes in flight per SM (blocks that fit x stages; two on a tie); FULCRUM_SKINNY_BULK_STAGES=1 / 2
// forces it. Raises the kernel's shared-memory limit once. blocks <= SMs x kBulkMaxBlocksPerSm (no grid-size check
// needed). Returns false when no block fits.
bool plan_bulk_grid(const void* kernel, int64_t tiles, int64_t tile_bytes, int& stages, int64_t& blocks);

// R for M x rows: wide where registers allow (FULCRUM_SKINNY_WIDE=0 keeps 4, for measurement; read once).
bool skinny_wide_enabled();
// Whether the bf16 skinny kernels load their first W trip before the wait (skinny_gemm_core.cuh FirstTrip;
// FULCRUM_SKINNY_EARLY_W=0: after it, for measurement; read once).
bool skinny_early_w_enabled();
// Whether the expert skinny kernels split their items evenly over the grid (FULCRUM_SKINNY_BALANCED=0: ceil(items /
// grid) a block, for measurement; read once).
bool skinny_balanced_enabled();
// Whether the bf16 one-row skinny kernels ask L2 for the next tile's / unit's first W trip ahead
// (prefetch_first_trip_l2; FULCRUM_SKINNY_L2_NEXT=0: not, for measurement; read once).
bool skinny_l2_next_enabled();
inline int rows_per_warp(int m) { return m <= 1 && skinny_wide_enabled() ? kWideRowsPerWarp : kRowsPerWarp; }

}  // namespace fulcrum::gpu::skinny
