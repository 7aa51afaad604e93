#pragma once
// Measurement switches of the GPU path (FULCRUM_PDL, FULCRUM_SKINNY_WIDE, FULCRUM_FUSED_ROUTER): on unless the
// environment sets the variable to "0". Callers read it once (a function-local static), never per launch.
// Opt-in switches (env_switch_set: off unless the variable is "1") hold paths that are built and tested in
// tests_cuda but not yet run on a GPU: FULCRUM_FP8_FUSED_PERMUTE. They become default-on once measured.
#include <cstdlib>
#include <cstring>

namespace fulcrum::gpu {

inline bool env_switch_on(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || std::strcmp(value, "0") != 0;
}

inline bool env_switch_set(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::strcmp(value, "1") == 0;
}

}  // namespace fulcrum::gpu
