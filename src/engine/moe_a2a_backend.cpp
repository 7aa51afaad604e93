#include "engine/moe_a2a_backend.hpp"

#include <array>

#include "eplb/error.hpp"

namespace fulcrum::engine {
namespace {

constexpr std::array<std::string_view, 5> kAllToAll = {"alltoall", "deepep", "mooncake", "mori", "nixl"};
constexpr std::array<std::string_view, 2> kAllGather = {"allgather", "none"};

}  // namespace

bool is_deepep_class_backend(std::string_view name) {
  for (std::string_view n : kAllToAll) {
    if (n == name) return true;
  }
  return false;
}

std::string moe_a2a_backend_names() {
  std::string out;
  for (std::string_view n : kAllGather) out += std::string(out.empty() ? "" : ", ") + std::string(n);
  for (std::string_view n : kAllToAll) out += ", " + std::string(n);
  return out;
}

MoeA2aBackend resolve_moe_a2a_backend(std::string_view name) {
  MoeA2aBackend out;
  out.given = std::string(name);
  out.deepep_class = is_deepep_class_backend(name);
  bool gathers = false;
  for (std::string_view n : kAllGather) gathers = gathers || n == name;
  FULCRUM_CHECK(out.deepep_class || gathers, "unknown --moe-a2a-backend '{}' (accepted: {})", name,
                moe_a2a_backend_names());
  out.dispatcher = out.deepep_class ? "alltoall" : "allgather";
  return out;
}

}  // namespace fulcrum::engine
