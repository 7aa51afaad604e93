#pragma once
// Measurement switches of the GPU path (FULCRUM_PDL, FULCRUM_SKINNY_WIDE, FULCRUM_FUSED_ROUTER,
// FULCRUM_FP8_FUSED_PERMUTE, FULCRUM_FUSED_CUTLASS_ROUTE): on unless the environment sets the variable to "0", so a
// fused path can be timed against the one it replaced. Callers read it once (a function-local static), never per
// launch. env_int reads the numeric ones the same way.
#include <cstdlib>
#include <cstring>

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

}  // namespace fulcrum::gpu
