#pragma once
// Measurement only: FULCRUM_ABLATE=part[,part...] skips those launches in every layer, so a decode step timed
// without them can be set beside the full step. With programmatic dependent launch inside a CUDA graph, kernels
// overlap their neighbours' prologues and tails, and a per-kernel profiler (which serializes them) cannot say what
// each one costs on the step's critical path; the difference of two step times can. The step's outputs are wrong
// while it is set (the engine says so on stderr when it starts). Read once; an unknown part is a one-line error.
// Parts: input_norm, qkv, rope, attention, o_proj, post_norm (GpuEngine), router (router logits GEMM), route (the
// routing / permutation launches), gate_up, down (the expert GEMMs: the skinny kernels, or CUTLASS's whole expert
// stage for gate_up), moe (the whole MoE layer).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "eplb/error.hpp"

namespace fulcrum::gpu {

enum class AblatePart : uint32_t {
  kInputNorm = 1u << 0,
  kQkv = 1u << 1,
  kRope = 1u << 2,
  kAttention = 1u << 3,
  kOProj = 1u << 4,
  kPostNorm = 1u << 5,
  kRouter = 1u << 6,
  kRoute = 1u << 7,
  kGateUp = 1u << 8,
  kDown = 1u << 9,
  kMoe = 1u << 10,
};

// The parts FULCRUM_ABLATE names, as a bit mask (0: none). Throws on a name not listed above.
inline uint32_t parse_ablation(const std::string& list) {
  static constexpr struct {
    const char* name;
    AblatePart part;
  } kParts[] = {{"input_norm", AblatePart::kInputNorm}, {"qkv", AblatePart::kQkv},           {"rope", AblatePart::kRope},
                {"attention", AblatePart::kAttention},  {"o_proj", AblatePart::kOProj},     {"post_norm", AblatePart::kPostNorm},
                {"router", AblatePart::kRouter},        {"route", AblatePart::kRoute},      {"gate_up", AblatePart::kGateUp},
                {"down", AblatePart::kDown},            {"moe", AblatePart::kMoe}};
  uint32_t mask = 0;
  size_t begin = 0;
  while (begin <= list.size()) {
    const size_t end = std::min(list.find(',', begin), list.size());
    const std::string name = list.substr(begin, end - begin);
    if (!name.empty()) {
      bool found = false;
      for (const auto& p : kParts) {
        if (name == p.name) {
          mask |= static_cast<uint32_t>(p.part);
          found = true;
        }
      }
      if (!found) {
        std::string known;
        for (const auto& p : kParts) known += (known.empty() ? "" : ", ") + std::string(p.name);
        FULCRUM_CHECK(false, "FULCRUM_ABLATE: unknown part '{}' ({})", name, known);
      }
    }
    begin = end + 1;
  }
  return mask;
}

inline uint32_t ablation_mask() {
  static const uint32_t mask = [] {
    const char* value = std::getenv("FULCRUM_ABLATE");
    return value == nullptr ? 0u : parse_ablation(value);
  }();
  return mask;
}

inline bool ablated(AblatePart part) { return (ablation_mask() & static_cast<uint32_t>(part)) != 0; }

}  // namespace fulcrum::gpu
