#pragma once
// Weights a later kernel of the step will stream, asked of L2 ahead by a kernel whose own work is latency-bound
// (the decode attention asks for the O projection; the router for the next layer's QKV projection), so HBM moves
// them while that kernel waits on latency instead of while the GEMM waits on HBM. Weights are never written
// during a step, so the kernel may issue the request before its griddepcontrol.wait; a request changes no result.
// FULCRUM_L2_AHEAD_O=0 / FULCRUM_L2_AHEAD_QKV=0 leave the two requests out, for measurement (read once).
#include <cstdint>

#include "gpu/env_switch.hpp"

namespace fulcrum::gpu {

struct L2Ahead {
  const void* data = nullptr;  // 16-byte aligned, or the request is dropped
  int64_t bytes = 0;
};

inline bool l2_ahead_o_enabled() {
  static const bool enabled = env_switch_on("FULCRUM_L2_AHEAD_O");
  return enabled;
}
inline bool l2_ahead_qkv_enabled() {
  static const bool enabled = env_switch_on("FULCRUM_L2_AHEAD_QKV");
  return enabled;
}

}  // namespace fulcrum::gpu
