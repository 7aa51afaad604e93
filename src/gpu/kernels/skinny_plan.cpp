// Host side of the skinny GEMMs' launches (skinny_plan.hpp).
#include "gpu/kernels/skinny_plan.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include <cuda_runtime.h>

#include "gpu/env_switch.hpp"

namespace fulcrum::gpu {

namespace skinny {

bool skinny_wide_enabled() {
  static const bool enabled = env_switch_on("FULCRUM_SKINNY_WIDE");
  return enabled;
}

bool skinny_early_w_enabled() {
  static const bool enabled = env_switch_on("FULCRUM_SKINNY_EARLY_W");
  return enabled;
}

bool skinny_l2_next_enabled() {
  static const bool enabled = env_switch_on("FULCRUM_SKINNY_L2_NEXT");
  return enabled;
}

bool skinny_balanced_enabled() {
  static const bool enabled = env_switch_on("FULCRUM_SKINNY_BALANCED");
  return enabled;
}

int skinny_blocks_per_sm(int m) {
  static const int forced = [] {  // -1: unset
    const long long v = env_int("FULCRUM_SKINNY_BLOCKS_PER_SM", std::numeric_limits<long long>::min());
    return v == std::numeric_limits<long long>::min() ? -1 : static_cast<int>(std::max(0LL, v));
  }();
  if (forced >= 0) return forced;
  return m <= 2 ? 4 : 6;
}

// The current device's SM count, read once per device (a launch only looks it up).
int device_sms() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sms_of[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    (void)cudaGetLastError();
    return 132;
  }
  int sms = sms_of[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return 132;
    }
    sms_of[device].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

int64_t skinny_target_warps() {
  static const int64_t target = std::max(1LL, env_int("FULCRUM_SKINNY_TARGET_WARPS", kTargetWarps));
  return target;
}

static bool skinny_even_grid() {
  static const bool enabled = [] {
    const char* env = std::getenv("FULCRUM_SKINNY_EVEN_GRID");
    return env != nullptr && std::strcmp(env, "1") == 0;
  }();
  return enabled;
}

int64_t skinny_grid_blocks(int64_t tiles, int m) {
  const int per_sm = skinny_blocks_per_sm(m);
  if (per_sm == 0) return tiles;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(tiles, int64_t{device_sms()} * per_sm));
  if (!skinny_even_grid() || blocks >= tiles) return blocks;
  const int64_t per_block = (tiles + blocks - 1) / blocks;
  return (tiles + per_block - 1) / per_block;
}



bool bulk_tile_allowed(int64_t tile_bytes, bool forced) {
  static const bool enabled = env_switch_on("FULCRUM_SKINNY_BULK");
  static const int64_t max_tile =
      std::min<int64_t>(kBulkMaxTileBytes, env_int("FULCRUM_SKINNY_BULK_MAX_TILE", kBulkMaxTileBytes));
  return forced ? tile_bytes <= kBulkMaxTileBytes : enabled && tile_bytes <= max_tile;
}

// Blocks of `kernel` with `smem` bytes of dynamic shared memory that fit on an SM (registers, shared memory),
// asked of the runtime once per device, kernel and size (the kernel's shared-memory limit raised once per device,
// to the most any size needs: a function attribute holds per device); 0 on error.
static int bulk_blocks_per_sm(const void* kernel, size_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, size_t>, int> known;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find({device, kernel, smem}); it != known.end()) return it->second;
  const bool limit_raised = std::any_of(known.begin(), known.end(), [&](const auto& entry) {
    return std::get<0>(entry.first) == device && std::get<1>(entry.first) == kernel;
  });
  if (!limit_raised && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(kBulkStages * kBulkMaxTileBytes)) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    blocks = 0;
  }
  blocks = std::min(blocks, kBulkMaxBlocksPerSm);
  known.emplace(std::make_tuple(device, kernel, smem), blocks);
  return blocks;
}

bool plan_bulk_grid(const void* kernel, int64_t tiles, int64_t tile_bytes, int& stages, int64_t& blocks) {
  static const long long forced = env_int("FULCRUM_SKINNY_BULK_STAGES", 0);
  const int64_t sms = device_sms();
  const auto per_sm = [&](int s) { return bulk_blocks_per_sm(kernel, static_cast<size_t>(s * tile_bytes)); };
  if (forced == 1 || forced == kBulkStages) {
    stages = static_cast<int>(forced);
  } else if (tiles <= sms * per_sm(1)) {
    stages = 1;
  } else {
    stages = per_sm(1) > kBulkStages * per_sm(kBulkStages) ? 1 : kBulkStages;
  }
  const int64_t resident = sms * per_sm(stages);
  blocks = std::min(tiles, resident);
  return resident > 0;
}

}  // namespace skinny

}  // namespace fulcrum::gpu
