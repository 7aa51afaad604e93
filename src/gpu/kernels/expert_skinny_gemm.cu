// Expert skinny GEMMs (expert_skinny_gemm.hpp). A persistent 1-D grid over the (active slot, column tile) items:
// an item is one slot's rows, kChunk at a time, against one column tile. A warp owns R W rows (8 for chunks of 1
// row, else 4: skinny::rows_per_warp): plain, R consecutive output columns; SwiGLU, R / 2 output columns
// j.. as gate rows j.. and up rows I + j.., so the activation is formed where the sums are. K slices as in the dense skinny GEMM (skinny_gemm_core.cuh), chosen
// from the grid's warps at max_rows rows. FP8 weights (kFp8): the same items and rows, W chunks of 16 e4m3
// weights and the block-scaled dot products of skinny_gemm_core.cuh (warp_dot_fp8).
#include <algorithm>
#include <cstdlib>
#include <string>

#include "gpu/kernels/expert_skinny_gemm.hpp"
#include "gpu/kernels/bulk_copy.cuh"
#include "gpu/kernels/dependent_launch.cuh"
#include "gpu/kernels/skinny_gemm_core.cuh"

namespace fulcrum::gpu {
namespace {

using namespace skinny;


__device__ __forceinline__ float bf16_round(float v) { return __uint_as_float(static_cast<uint32_t>(to_bf16(v)) << 16); }

// Output columns of a warp's R rows.
template <bool kSwiGlu, int R>
constexpr int kColsPerWarp = kSwiGlu ? R / 2 : R;

// FP8 weights only: the scale column of the warp's rows in the slot's table [k / 128][w_rows / 128] (n % 128 == 0,
// so a warp's rows lie in one 128-row block: with SwiGLU one for the gate rows, one for the up rows).
struct Fp8ScaleCols {
  const float* col[2] = {nullptr, nullptr};
  int64_t stride = 0;  // w_rows / 128
};

// The warp's dot products of rows [r0, r0 + M) of the block's slot with its W rows (acc, summed over the warp).
template <int R, int M, bool kSwiGlu, bool kFp8, bool kFirst, bool kShared = false>
__device__ __forceinline__ void rows_dot(const ExpertSkinnyArgs& a, const uint4* const (&w_rows)[R],
                                         const Fp8ScaleCols& scales, int r0, int64_t begin, int64_t end, int lane,
                                         const FirstTrip<R>* first, float (&acc)[R][M]) {
  const int64_t chunks = a.k / 8;
  const uint4* x_rows[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    const int64_t src = a.row_source != nullptr ? load_produced(a.row_source + r0 + i) : r0 + i;
    x_rows[i] = reinterpret_cast<const uint4*>(a.x) + src * chunks;
  }
  if constexpr (kShared) {  // W rows bulk-copied to shared memory (bf16)
    warp_dot_shared<R, M>(w_rows, x_rows, begin, end, lane, acc);
  } else if constexpr (kFp8) {
    warp_dot_fp8<R, M, kSwiGlu ? 2 : 1>(w_rows, x_rows, scales.col, scales.stride, begin, end, lane, acc);
  } else {
    warp_dot<R, M, kFirst>(w_rows, x_rows, begin, end, lane, acc, first);
  }
}

// The block's slice sums of rows_dot's products, then its columns of rows [r0, r0 + M) stored.
template <int R, int M, bool kSwiGlu>
__device__ __forceinline__ void rows_store(const ExpertSkinnyArgs& a, const float (&acc)[R][M], int r0, int warp,
                                           int lane, int k_split, int64_t first_col,
                                           float (*partial)[kRowsPerWarp * kMaxRows]) {
  sum_slices<R, M>(acc, warp, lane, k_split, partial);
  const int t = static_cast<int>(threadIdx.x), groups = kWarpsPerBlock / k_split;
  constexpr int kCols = kColsPerWarp<kSwiGlu, R>;
  if constexpr (kSwiGlu) {
    // Thread (group, column c, row i): gate at W row c, up at W row R / 2 + c of the group.
    if (t < groups * kCols * M) {
      const int group = t / (kCols * M), c = t % (kCols * M) / M, i = t % M;
      const int64_t col = first_col + group * kCols + c;
      if (col < a.n) {
        const float g = bf16_round(partial[group * k_split][c * M + i]);
        const float u = bf16_round(partial[group * k_split][(kCols + c) * M + i]);
        a.out[static_cast<int64_t>(r0 + i) * a.n + col] = to_bf16(g / (1.0f + expf(-g)) * u);
      }
    }
  } else {
    if (t < groups * R * M) {
      const int group = t / (R * M), j = t % (R * M), r = j / M, i = j % M;
      const int64_t col = first_col + group * R + r;
      if (col < a.n) a.out[static_cast<int64_t>(r0 + i) * a.n + col] = to_bf16(partial[group * k_split][j]);
    }
  }
  __syncthreads();  // partial is rewritten by the next rows
}

// Rows [r0, r0 + M) of the block's slot against the warp's W rows; stores the block's columns.
template <int R, int M, bool kSwiGlu, bool kFp8, bool kShared = false>
__device__ __forceinline__ void rows_times_w(const ExpertSkinnyArgs& a, const uint4* const (&w_rows)[R],
                                             const Fp8ScaleCols& scales, int r0, int64_t begin, int64_t end, int warp,
                                             int lane, int k_split, int64_t first_col,
                                             float (*partial)[kRowsPerWarp * kMaxRows]) {
  float acc[R][M];
  rows_dot<R, M, kSwiGlu, kFp8, false, kShared>(a, w_rows, scales, r0, begin, end, lane, nullptr, acc);
  rows_store<R, M, kSwiGlu>(a, acc, r0, warp, lane, k_split, first_col, partial);
}

// rows_times_w for the m rows of a chunk (1 <= m <= kChunk; m is uniform over the block). Only the variant
// depends on kChunk, never a row's result, so kChunk may follow how many rows a slot can hold at most: the kernel
// for 1-row chunks needs a fraction of the registers of the one for 8 and fits twice the warps per SM.
template <int R, int M, bool kSwiGlu, bool kFp8, int kChunk, bool kShared = false>
__device__ __forceinline__ void rows_in_chunk(int m, const ExpertSkinnyArgs& a, const uint4* const (&w_rows)[R],
                                              const Fp8ScaleCols& scales, int r0, int64_t begin,
                                              int64_t end, int warp, int lane, int k_split, int64_t first_col,
                                              float (*partial)[kRowsPerWarp * kMaxRows]) {
  if constexpr (M < kChunk) {
    if (m != M) {
      rows_in_chunk<R, M + 1, kSwiGlu, kFp8, kChunk, kShared>(m, a, w_rows, scales, r0, begin, end, warp, lane,
                                                              k_split, first_col, partial);
      return;
    }
  }
  rows_times_w<R, M, kSwiGlu, kFp8, kShared>(a, w_rows, scales, r0, begin, end, warp, lane, k_split, first_col,
                                             partial);
}

// Block b takes a contiguous range of the active slots' (slot, column tile) items, slot-major, so consecutive
// items of a block mostly share a slot and its row range: b * items / grid on (balanced: every block busy; at
// batch 1 the gate_up GEMM has 768 items for 528 blocks), or ceil(items / grid) each (FULCRUM_SKINNY_BALANCED=0,
// for measurement: there 384 blocks take two and 144 none). Which block takes an item never changes its result.
// With a.plan_ready_early (bf16, 1-row chunks) the block reads the plan and loads its first item's first W trip
// before the wait (FirstTrip, skinny_gemm_core.cuh). 1-row chunks: at most 128 registers, so the 4 blocks per SM
// of the persistent grid (skinny_blocks_per_sm(1)) are all resident (ptxas otherwise gives the FP8 SwiGLU one 161
// and the bf16 ones with the first trip 168: 3 blocks per SM); chunks of more rows: no minimum, as tuned.
template <bool kSwiGlu, bool kFp8, int kChunk, int R>
__global__ void __launch_bounds__(kThreads, kChunk == 1 ? 4 : 0)
    expert_skinny_kernel(const ExpertSkinnyArgs a, int k_split, int tiles, bool balanced, bool l2_next) {
  // The first W trip ahead: bf16 with 1-row chunks only (chunks of 2..8 rows went from 120..168 to 127..255 registers
  // with it, fewer resident blocks).
  constexpr bool kFirstTrip = !kFp8 && kChunk == 1;
  const bool early = kFirstTrip && a.plan_ready_early;
  if (!early) wait_then_release();  // dependent_launch.cuh: before any read of an earlier kernel's output
  __shared__ float partial[kWarpsPerBlock][kRowsPerWarp * kMaxRows];
  const int64_t items = static_cast<int64_t>(load_produced(a.active)) * tiles;
  int64_t item_begin, item_end;
  if (balanced) {  // within one item of each other
    item_begin = blockIdx.x * items / gridDim.x;
    item_end = (blockIdx.x + 1) * items / gridDim.x;
  } else {  // ceil(items / grid) each: the last blocks may get none
    const int64_t per_block = (items + gridDim.x - 1) / gridDim.x;
    item_begin = min(items, blockIdx.x * per_block);
    item_end = min(items, item_begin + per_block);
  }
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int groups_per_block = kWarpsPerBlock / k_split, group = warp / k_split, slice = warp % k_split;
  constexpr int kColsPerGroup = kColsPerWarp<kSwiGlu, R>;
  const int64_t chunks = kFp8 ? a.k / kFp8ChunkValues : a.k / 8;  // W chunks per row
  const int64_t begin = chunks * slice / k_split, end = chunks * (slice + 1) / k_split;
  int slot_index = -1, row_begin = 0, row_end = 0;
  const uint4* w = nullptr;
  const float* slot_scales = nullptr;  // FP8: [k / 128][w_rows / 128]
  Fp8ScaleCols scales;
  if constexpr (kFp8) scales.stride = (kSwiGlu ? 2 * int64_t{a.n} : a.n) / kFp8BlockValues;
  const uint4* w_rows[R];
  // Item `item`'s slot (its row range and weights, read when the slot changes) and the warp's W rows in it.
  const auto enter_item = [&](int64_t item) {
    const int y = static_cast<int>(item / tiles);
    if (y != slot_index) {
      slot_index = y;
      const int slot = load_produced(a.active + 1 + y);
      row_begin = load_produced(a.offsets + slot);
      row_end = load_produced(a.offsets + slot + 1);
      if constexpr (kFp8) {
        w = reinterpret_cast<const uint4*>(a.fp8_weights[slot]);
        slot_scales = a.fp8_scales[slot];
      } else {
        w = reinterpret_cast<const uint4*>(a.weights[slot]);
      }
    }
    const int64_t first_col = (item % tiles) * groups_per_block * kColsPerGroup;
    // Columns past n read the last column's rows and store nothing.
#pragma unroll
    for (int r = 0; r < R; ++r) {
      int64_t row;
      if constexpr (kSwiGlu) {
        const int64_t col = min(first_col + group * kColsPerGroup + r % kColsPerGroup, static_cast<int64_t>(a.n - 1));
        row = r < kColsPerGroup ? col : a.n + col;
      } else {
        row = min(first_col + group * kColsPerGroup + r, static_cast<int64_t>(a.n - 1));
      }
      w_rows[r] = w + row * chunks;
      if constexpr (kFp8) {
        if (r == 0 || (kSwiGlu && r == kColsPerGroup)) scales.col[r == 0 ? 0 : 1] = slot_scales + row / kFp8BlockValues;
      }
    }
    return first_col;
  };
  int64_t item = item_begin;
  if constexpr (kFirstTrip) {
    // One row a unit (item, row r0). The block's first unit starts from its first W trip, loaded before the wait
    // when the plan allows (a.plan_ready_early), else right after it; every later unit's first trip is asked of L2
    // before the slice sums of the unit before (into registers there, the kernel spilled 656 bytes at 128).
    FirstTrip<R> first;
    int r0 = 0;
    int64_t first_col = 0;
    const auto settle = [&]() {  // from (item, r0) on to the next unit that has a row
      while (item < item_end && r0 >= row_end) {
        if (++item < item_end) {
          first_col = enter_item(item);
          r0 = row_begin;
        }
      }
    };
    if (item < item_end) {
      first_col = enter_item(item);
      r0 = row_begin;
      settle();
    }
    if (item < item_end) load_first_trip<R>(w_rows, begin, end, lane, first);
    if (early) wait_then_release();  // the x rows come from the previous kernel
    // A unit's slice sums and stores, once the next unit is found and L2 asked for its first W trip.
    const auto finish = [&](const float (&acc)[R][1]) {
      const int row = r0;
      const int64_t col = first_col;
      ++r0;
      settle();
      if (l2_next && item < item_end) prefetch_first_trip_l2<R>(w_rows, begin, end, lane);
      rows_store<R, 1, kSwiGlu>(a, acc, row, warp, lane, k_split, col, partial);
    };
    if (item < item_end) {
      float acc[R][1];
      rows_dot<R, 1, kSwiGlu, kFp8, true>(a, w_rows, scales, r0, begin, end, lane, &first, acc);
      finish(acc);
    }
    while (item < item_end) {
      float acc[R][1];
      rows_dot<R, 1, kSwiGlu, kFp8, false>(a, w_rows, scales, r0, begin, end, lane, nullptr, acc);
      finish(acc);
    }
  } else {
    for (; item < item_end; ++item) {
      const int64_t first_col = enter_item(item);
      for (int r0 = row_begin; r0 < row_end; r0 += kChunk) {
        rows_in_chunk<R, 1, kSwiGlu, kFp8, kChunk>(min(kChunk, row_end - r0), a, w_rows, scales, r0, begin, end, warp,
                                                   lane, k_split, first_col, partial);
      }
    }
  }
}

// bf16 weights by bulk copies (expert_bulk_enabled below; skinny_plan.hpp): the same items, warps, K slices and
// arithmetic as expert_skinny_kernel (so the same bits) and its even item ranges (always: FULCRUM_SKINNY_BALANCED
// does not apply), but an item's W rows reach shared memory whole, one bulk copy per contiguous piece (SwiGLU: its
// gate rows and its up rows; plain: its rows), through
// `stages` buffers: a block asks for its first items' rows as soon as it knows its slots (before the wait when
// a.plan_ready_early, the down GEMM's case), and for item j + stages once its warps are done with item j.
template <bool kSwiGlu, int kChunk, int R>
__global__ void __launch_bounds__(kThreads) expert_skinny_bulk_kernel(const ExpertSkinnyArgs a, int k_split, int tiles,
                                                                      int stages) {
  extern __shared__ __align__(128) uint4 stage_chunks[];  // [stages][pieces][tile columns][k / 8]
  __shared__ __align__(8) uint64_t full[kBulkStages];
  __shared__ float partial[kWarpsPerBlock][kRowsPerWarp * kMaxRows];
  if (!a.plan_ready_early) wait_then_release();  // dependent_launch.cuh: the plan comes from the previous kernel
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int groups_per_block = kWarpsPerBlock / k_split, group = warp / k_split, slice = warp % k_split;
  constexpr int kCols = kColsPerWarp<kSwiGlu, R>;
  constexpr int kPieces = kSwiGlu ? 2 : 1;
  const int tile_cols = groups_per_block * kCols;  // output columns of an item (W rows of each piece)
  const int64_t chunks = a.k / 8;                  // per W row
  const int64_t piece = tile_cols * chunks, per_stage = kPieces * piece;
  const int64_t items = static_cast<int64_t>(load_produced(a.active)) * tiles;
  const int64_t item_begin = blockIdx.x * items / gridDim.x, item_end = (blockIdx.x + 1) * items / gridDim.x;
  const auto columns_of = [&](int64_t item) {
    return static_cast<int>(min(static_cast<int64_t>(tile_cols), a.n - (item % tiles) * tile_cols));
  };
  const auto ask = [&](int stage, int64_t item) {  // one thread
    const int slot = load_produced(a.active + 1 + item / tiles);
    const uint4* w = reinterpret_cast<const uint4*>(a.weights[slot]);
    const int64_t first_col = (item % tiles) * tile_cols;
    const uint32_t bytes = static_cast<uint32_t>(columns_of(item) * chunks * 16);
    bulk::expect_bytes(&full[stage], kPieces * bytes);
    for (int p = 0; p < kPieces; ++p) {  // gate rows first_col.., up rows n + first_col..
      bulk::copy_bytes(stage_chunks + stage * per_stage + p * piece, w + (p * int64_t{a.n} + first_col) * chunks,
                       bytes, &full[stage]);
    }
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) bulk::barrier_init(&full[s]);
    for (int s = 0; s < stages && item_begin + s < item_end; ++s) ask(s, item_begin + s);
  }
  __syncthreads();  // the barriers are initialized before anyone waits on them
  if (a.plan_ready_early) wait_then_release();  // the x rows come from the previous kernel
  const int64_t begin = chunks * slice / k_split, end = chunks * (slice + 1) / k_split;
  const Fp8ScaleCols no_scales;
  int use = 0;
  for (int64_t item = item_begin; item < item_end; ++item, ++use) {
    const int stage = use % stages;
    bulk::wait_phase(&full[stage], static_cast<uint32_t>(use / stages) & 1u);
    const int slot = load_produced(a.active + 1 + item / tiles);
    const int row_begin = load_produced(a.offsets + slot), row_end = load_produced(a.offsets + slot + 1);
    const int last = columns_of(item) - 1;  // columns past n read the last column's rows and store nothing
    const uint4* w_rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int col = min(group * kCols + r % kCols, last);
      w_rows[r] = stage_chunks + stage * per_stage + (r < kCols ? 0 : piece) + col * chunks;
    }
    const int64_t first_col = (item % tiles) * tile_cols;
    for (int r0 = row_begin; r0 < row_end; r0 += kChunk) {
      rows_in_chunk<R, 1, kSwiGlu, false, kChunk, true>(min(kChunk, row_end - r0), a, w_rows, no_scales, r0, begin,
                                                        end, warp, lane, k_split, first_col, partial);
    }
    __syncthreads();  // every warp is done with the stage (also when the slot had no rows)
    if (threadIdx.x == 0 && item + stages < item_end) {
      bulk::fence_before_async_write();
      ask(stage, item + stages);
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <bool kSwiGlu, bool kFp8 = false>
cudaError_t launch_chunked(int chunk, bool wide, const ExpertSkinnyArgs& a, int64_t blocks, int k_split, int tiles,
                           cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(blocks)), block(kThreads);
  constexpr int kWide = kWideRowsPerWarp, kNarrow = kRowsPerWarp;
  const bool balanced = skinny_balanced_enabled(), l2_next = skinny_l2_next_enabled();
  switch (chunk) {
    case 1:
      return wide ? launch_dependent(expert_skinny_kernel<kSwiGlu, kFp8, 1, kWide>, grid, block, 0, stream, a, k_split,
                                     tiles, balanced, l2_next)
                  : launch_dependent(expert_skinny_kernel<kSwiGlu, kFp8, 1, kNarrow>, grid, block, 0, stream, a,
                                     k_split, tiles, balanced, l2_next);
    case 2:
      return launch_dependent(expert_skinny_kernel<kSwiGlu, kFp8, 2, kNarrow>, grid, block, 0, stream, a, k_split,
                              tiles, balanced, l2_next);
    case 4:
      return launch_dependent(expert_skinny_kernel<kSwiGlu, kFp8, 4, kNarrow>, grid, block, 0, stream, a, k_split,
                              tiles, balanced, l2_next);
    default:
      return launch_dependent(expert_skinny_kernel<kSwiGlu, kFp8, kMaxRows, kNarrow>, grid, block, 0, stream, a,
                              k_split, tiles, balanced, l2_next);
  }
}

// Bulk copies for the expert GEMMs, by measurement on the H200 (bench/results/expert_bulk_sweep_55ebc94_h200.json,
// expert_bulk_parts_sweep_5a9ac4a_h200.json): the down GEMM of steps with 2+ rows a slot (chunks of 2..8; before
// its wait, plan_ready_early) takes them (batch 2 / 4 3.877 / 5.783 ms against 3.906-3.909 / 5.928-5.944 on
// register loads); its 1-row chunks (batch 1: 2.861 against 2.805-2.819) and the gate_up GEMM (after its wait;
// batch 1 / 4 2.925 / 6.135) do not. FULCRUM_EXPERT_SKINNY_BULK=0 / 1 / down / gate_up: none, both, one (every
// chunk), for measurement; read once.
bool expert_bulk_enabled(bool swiglu, int chunk) {
  static const std::string value = [] {
    const char* env = std::getenv("FULCRUM_EXPERT_SKINNY_BULK");
    return std::string(env != nullptr && *env != '\0' ? env : "auto");
  }();
  if (value == "auto") return !swiglu && chunk >= 2;
  return value == "1" || value == (swiglu ? "gate_up" : "down");
}

// The bulk kernel for this launch, or cudaErrorNotSupported when it does not apply (switched off, or an item's
// rows larger than kBulkMaxTileBytes), for the register path.
// max_items bounds the items (at most max_rows slots have rows), so the grid and the stages come from it; the
// kernel balances the items it finds on the device.
template <bool kSwiGlu>
cudaError_t launch_bulk_chunked(int chunk, bool wide, const ExpertSkinnyArgs& a, int k_split, int tiles,
                                int64_t tile_cols, int64_t max_items, cudaStream_t stream) {
  const int64_t tile_bytes = (kSwiGlu ? 2 : 1) * tile_cols * a.k * 2;
  const bool forced = a.loads == SkinnyWeightLoads::kBulk;
  if (!(forced || expert_bulk_enabled(kSwiGlu, chunk)) || !bulk_tile_allowed(tile_bytes, forced)) {
    return cudaErrorNotSupported;
  }
  const auto pick = [&]() -> void (*)(const ExpertSkinnyArgs, int, int, int) {
    switch (chunk) {
      case 1: return wide ? expert_skinny_bulk_kernel<kSwiGlu, 1, kWideRowsPerWarp>
                          : expert_skinny_bulk_kernel<kSwiGlu, 1, kRowsPerWarp>;
      case 2: return expert_skinny_bulk_kernel<kSwiGlu, 2, kRowsPerWarp>;
      case 4: return expert_skinny_bulk_kernel<kSwiGlu, 4, kRowsPerWarp>;
      default: return expert_skinny_bulk_kernel<kSwiGlu, kMaxRows, kRowsPerWarp>;
    }
  };
  const auto kernel = pick();
  int stages = 0;
  int64_t blocks = 0;
  if (!plan_bulk_grid(reinterpret_cast<const void*>(kernel), max_items, tile_bytes, stages, blocks)) {
    return cudaErrorNotSupported;
  }
  return launch_dependent(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                          static_cast<size_t>(stages * tile_bytes), stream, a, k_split, tiles, stages);
}

}  // namespace

cudaError_t launch_expert_skinny_gemm(const ExpertSkinnyArgs& args, cudaStream_t stream) {
  ExpertSkinnyArgs a = args;
  a.plan_ready_early = a.plan_ready_early && skinny_early_w_enabled();
  if (a.n < 1 || a.k <= 0 || a.k % 8 != 0 || a.max_rows < 1 || a.num_slots < 1) return cudaErrorInvalidValue;
  // Exactly one kind of weights: bf16, or e4m3 with their scales (whole 128 x 128 blocks).
  const bool fp8 = a.fp8_weights != nullptr;
  if (fp8 ? a.weights != nullptr || a.fp8_scales == nullptr || a.n % kFp8BlockValues != 0 ||
                a.k % kFp8BlockValues != 0
          : a.weights == nullptr || a.fp8_scales != nullptr) {
    return cudaErrorInvalidValue;
  }
  if (a.x == nullptr || a.offsets == nullptr || a.active == nullptr || a.out == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (!aligned16(a.x) || reinterpret_cast<uintptr_t>(a.out) % alignof(uint16_t) != 0) return cudaErrorInvalidValue;
  const int slot_rows = a.max_slot_rows > 0 ? std::min(a.max_slot_rows, a.max_rows) : a.max_rows;
  const int chunk = slot_rows <= 1 ? 1 : slot_rows <= 2 ? 2 : slot_rows <= 4 ? 4 : kMaxRows;
  const int rows_per_group = rows_per_warp(chunk);
  // The K split from groups of 4 W rows whatever R (so R never changes a result), and the grid's warps if every
  // row had its own slot: at most max_rows slots have rows.
  const auto columns_of = [&](int w_rows) { return a.swiglu ? w_rows / 2 : w_rows; };
  const int64_t split_groups = (static_cast<int64_t>(a.n) + columns_of(kRowsPerWarp) - 1) / columns_of(kRowsPerWarp);
  const int k_split = choose_k_split(split_groups * a.max_rows, fp8 ? a.k / kFp8ChunkValues : a.k / 8);
  const int64_t col_groups = (static_cast<int64_t>(a.n) + columns_of(rows_per_group) - 1) / columns_of(rows_per_group);
  const int groups_per_block = kWarpsPerBlock / k_split;
  const int64_t tiles = (col_groups + groups_per_block - 1) / groups_per_block;
  const int64_t tile_cols = int64_t{groups_per_block} * columns_of(rows_per_group);  // output columns of a tile
  const int64_t max_items = tiles * std::min(a.max_rows, a.num_slots);
  const int64_t blocks = skinny_grid_blocks(max_items, chunk);
  if (tiles > INT32_MAX || blocks > INT32_MAX) return cudaErrorInvalidValue;
  const bool wide = rows_per_group == kWideRowsPerWarp;
  if (!fp8 && a.loads != SkinnyWeightLoads::kRegisters) {
    const cudaError_t bulk =
        a.swiglu ? launch_bulk_chunked<true>(chunk, wide, a, k_split, static_cast<int>(tiles), tile_cols, max_items,
                                             stream)
                 : launch_bulk_chunked<false>(chunk, wide, a, k_split, static_cast<int>(tiles), tile_cols, max_items,
                                              stream);
    if (bulk != cudaErrorNotSupported) return bulk;
  }
  if (fp8) {
    return a.swiglu ? launch_chunked<true, true>(chunk, wide, a, blocks, k_split, static_cast<int>(tiles), stream)
                    : launch_chunked<false, true>(chunk, wide, a, blocks, k_split, static_cast<int>(tiles), stream);
  }
  return a.swiglu ? launch_chunked<true>(chunk, wide, a, blocks, k_split, static_cast<int>(tiles), stream)
                  : launch_chunked<false>(chunk, wide, a, blocks, k_split, static_cast<int>(tiles), stream);
}

}  // namespace fulcrum::gpu
