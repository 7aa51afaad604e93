#pragma once
// Measurement switches of the GPU path (FULCRUM_PDL, FULCRUM_SKINNY_WIDE, FULCRUM_FUSED_ROUTER,
// FULCRUM_FP8_FUSED_PERMUTE, FULCRUM_FUSED_CUTLASS_ROUTE): on unless the environment sets the variable to "0", so a
// fused path can be timed against the one it replaced. Callers read it once (a function-local static), never per
// launch. env_int reads the numeric ones the same way.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace fulcrum::gpu {

inline bool env_switch_on(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || std::strcmp(value, "0") != 0;
}

// A numeric measurement setting: the variable's value as an integer, or `fallback` when it is unset or empty.
inline long long env_int(const char* name, long long fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::atoll(value) : fallback;
}

// A pair of config indices "U,D" (the gate_up and the down GEMM's grouped GEMM configs), each in [0, count);
// {-1, -1} when the variable is unset or not such a pair.
inline std::pair<int, int> env_config_pair(const char* name, int count) {
  const char* env = std::getenv(name);
  int up = -1, down = -1;
  if (env != nullptr && std::sscanf(env, "%d,%d", &up, &down) == 2 && up >= 0 && down >= 0 && up < count &&
      down < count) {
    return {up, down};
  }
  return {-1, -1};
}

}  // namespace fulcrum::gpu
